"""The per-rank streaming runtime: credit-based channels (``streamrft.runtime.channels``), stages,
the phase controller and the driver. Import the submodule you need; nothing is imported here."""
