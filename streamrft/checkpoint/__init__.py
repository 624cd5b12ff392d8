"""Sharded checkpoints with exact resume (manager.py), the resume guard (guard.py), their layout on disk
(layout.py), RNG states and determinism (rng.py), and Hugging Face export (export.py)."""

from streamrft.checkpoint.guard import check_resume, config_diff
from streamrft.checkpoint.layout import (
    complete_checkpoints,
    latest_checkpoint,
    loadable_checkpoints,
    read_meta,
    resolve_checkpoint,
    rotate,
    step_dir,
)
from streamrft.checkpoint.background import CheckpointSaveError
from streamrft.checkpoint.manager import Checkpointer, CheckpointWriteError, Resumed, reset_steps_log
from streamrft.checkpoint.rng import rng_state, set_deterministic, set_rng_state

__all__ = [
    "CheckpointSaveError",
    "CheckpointWriteError",
    "Checkpointer",
    "Resumed",
    "check_resume",
    "complete_checkpoints",
    "config_diff",
    "latest_checkpoint",
    "loadable_checkpoints",
    "read_meta",
    "reset_steps_log",
    "resolve_checkpoint",
    "rng_state",
    "rotate",
    "set_deterministic",
    "set_rng_state",
    "step_dir",
]
