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
    # Write checkpoints in a background thread: the step continues once the state is copied to host memory;
    # meta.json is still written last, after every rank's shards. auto = on for FSDP2 on a GPU, off otherwise
    # (true works on CPU too; DeepSpeed writes its own checkpoints and refuses true).
    async_save: Union[Literal["auto"], bool] = "auto"
    # async saves: the longest a save waits for the previous one (and the run's end for the last one), and
    # the timeout of the ranks' write collective; past it the run fails naming the checkpoint and rank.
    save_timeout_s: float = 600.0


def resume_mode(c: CheckpointConfig) -> str:
    """checkpoint.resume as one of RESUME_MODES (the booleans of older configs map to auto / never)."""
    if isinstance(c.resume, bool):
        return "auto" if c.resume else "never"
    return c.resume


def async_save_enabled(cfg, device_type: str) -> bool:
    """checkpoint.async_save resolved for a run on ``device_type`` ("cuda" | "cpu")."""
    if cfg.checkpoint.async_save == "auto":
        return cfg.train.strategy == "fsdp2" and device_type == "cuda"
    return bool(cfg.checkpoint.async_save)


def validate_checkpoint(cfg) -> None:
    """Raise ConfigError for checkpoint settings that cannot run (only raises)."""
    c = cfg.checkpoint
    if c.save_every < 0:
        raise ConfigError(f"checkpoint.save_every={c.save_every} must be >= 0 (0 = only on SIGTERM and at the end)")
    if c.keep < 1:
        raise ConfigError(f"checkpoint.keep={c.keep} must be >= 1 (the newest checkpoints kept)")
    if c.signal_timeout_s <= 0:
        raise ConfigError(f"checkpoint.signal_timeout_s={c.signal_timeout_s} must be > 0 seconds")
    if c.save_timeout_s <= 0:
        raise ConfigError(f"checkpoint.save_timeout_s={c.save_timeout_s} must be > 0 seconds")
    if c.async_save is True and cfg.train.strategy == "deepspeed":
        raise ConfigError("checkpoint.async_save=true needs train.strategy=fsdp2 (DeepSpeed writes its own "
                          "checkpoints synchronously); set checkpoint.async_save=false or auto")
