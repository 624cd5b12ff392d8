"""Model builders and loaders: tiny local models for CPU demos (``tiny``), hub ids and the local cache (``hub``).
Import the submodule you need; nothing is imported here (the reward service reads ``hub`` and needs no torch)."""
