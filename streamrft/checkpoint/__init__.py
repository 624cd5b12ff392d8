"""Sharded checkpoints with exact resume (manager.py), their layout on disk (layout.py), RNG states and
determinism (rng.py), and Hugging Face export (export.py)."""

from streamrft.checkpoint.layout import (
    complete_checkpoints,
    latest_checkpoint,
    read_meta,
    resolve_checkpoint,
    rotate,
    step_dir,
)
from streamrft.checkpoint.manager import Checkpointer, Resumed, reset_steps_log
from streamrft.checkpoint.rng import rng_state, set_deterministic, set_rng_state

__all__ = [
    "Checkpointer",
    "Resumed",
    "complete_checkpoints",
    "latest_checkpoint",
    "read_meta",
    "reset_steps_log",
    "resolve_checkpoint",
    "rng_state",
    "rotate",
    "set_deterministic",
    "set_rng_state",
    "step_dir",
]
