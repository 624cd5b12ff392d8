from __future__ import annotations

from typing import Literal, Union

from streamrft.config.base import ConfigError, Section

RESUME_MODES = ("auto", "never", "required")


class CheckpointConfig(Section):
    save_every: int = 0  # save every N steps; 0 = only on SIGTERM / end
    keep: int = 2  # checkpoints kept (rotation): the newest `keep` complete ones under output_dir/checkpoints
    # auto: resume from the newest complete checkpoint in output_dir if there is one; never: start fresh, and an
    # output_dir that holds checkpoints is an error; required: an output_dir without one is an error.
    # The old booleans still work: true = auto, false = never.
    resume: Union[Literal["auto", "never", "required"], bool] = "auto"
    signal_timeout_s: float = 30.0  # on SIGTERM: how long ranks wait for each other to agree on the step to save


def resume_mode(c: CheckpointConfig) -> str:
    """checkpoint.resume as one of RESUME_MODES (the booleans of older configs map to auto / never)."""
    if isinstance(c.resume, bool):
        return "auto" if c.resume else "never"
    return c.resume


def validate_checkpoint(cfg) -> None:
    """Raise ConfigError for checkpoint settings that cannot run (only raises)."""
    c = cfg.checkpoint
    if c.save_every < 0:
        raise ConfigError(f"checkpoint.save_every={c.save_every} must be >= 0 (0 = only on SIGTERM and at the end)")
    if c.keep < 1:
        raise ConfigError(f"checkpoint.keep={c.keep} must be >= 1 (the newest checkpoints kept)")
    if c.signal_timeout_s <= 0:
        raise ConfigError(f"checkpoint.signal_timeout_s={c.signal_timeout_s} must be > 0 seconds")
