from __future__ import annotations

from streamrft.config.base import ConfigError, Section


class CheckpointConfig(Section):
    save_every: int = 0  # save every N steps; 0 = only on SIGTERM / end
    keep: int = 2  # checkpoints kept (rotation): the newest `keep` complete ones under output_dir/checkpoints
    resume: bool = True  # resume from the latest complete checkpoint in output_dir if present
    signal_timeout_s: float = 30.0  # on SIGTERM: how long ranks wait for each other to agree on the step to save


def validate_checkpoint(cfg) -> None:
    """Raise ConfigError for checkpoint settings that cannot run (only raises)."""
    c = cfg.checkpoint
    if c.save_every < 0:
        raise ConfigError(f"checkpoint.save_every={c.save_every} must be >= 0 (0 = only on SIGTERM and at the end)")
    if c.keep < 1:
        raise ConfigError(f"checkpoint.keep={c.keep} must be >= 1 (the newest checkpoints kept)")
    if c.signal_timeout_s <= 0:
        raise ConfigError(f"checkpoint.signal_timeout_s={c.signal_timeout_s} must be > 0 seconds")
