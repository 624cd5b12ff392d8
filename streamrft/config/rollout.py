from __future__ import annotations

from typing import Literal

from streamrft.config.base import ConfigError, Section


class RolloutConfig(Section):
    n_samples_per_prompt: int = 8  # samples per prompt group
    prompts_per_step: int = 16  # global prompt groups per train step (across all ranks)
    # A group planned for train step k is admitted only while the engine's policy version is >= k - max_staleness:
    # 0 = on-policy (the step-synchronous loop, bitwise); 1 = the next step's groups may be generated early.
    max_staleness: int = 0
    stale_policy: Literal["drop", "wait"] = "drop"  # a sample found stale at take time: drop and count it, or (wait) error
    placement: Literal["colocated", "async"] = "colocated"  # engine on the learner's devices (sleep/wake) or its own processes
    engine_ranks: int = 1  # async: engine processes (each generates its share of the prompts)
    # async on a GPU shared with the learner (one GPU, overlapped): the share of the device's memory each engine
    # process may allocate (torch.cuda.set_per_process_memory_fraction); 0 = no cap
    engine_memory_fraction: float = 0.0
    channel_capacity: int = 256  # credits of each stage inbox (bounds memory; groups in flight = capacity // n_samples_per_prompt)
    stage_timeout_s: float = 600.0  # any wait longer than this is an error naming stage and rank
    channel_transport: str = "inproc"  # inproc | ipc | tcp, for the in-rank stage channels


def validate_rollout_runtime(cfg, world_size: int) -> None:
    """Staleness, placement and replay settings that cannot work (before anything starts)."""
    r = cfg.rollout
    if r.max_staleness < 0:
        raise ConfigError(f"rollout.max_staleness={r.max_staleness} must be >= 0 (0 = on-policy)")
    if r.engine_ranks < 1:
        raise ConfigError(f"rollout.engine_ranks={r.engine_ranks} must be >= 1")
    if r.placement == "colocated" and r.engine_ranks != 1:
        raise ConfigError(f"rollout.engine_ranks={r.engine_ranks} applies to rollout.placement=async only; "
                          "colocated, every learner rank generates its own share")
    if not 0.0 <= r.engine_memory_fraction < 1.0:
        raise ConfigError(f"rollout.engine_memory_fraction={r.engine_memory_fraction} must be in [0, 1)")
    if r.engine_memory_fraction and r.placement != "async":
        raise ConfigError("rollout.engine_memory_fraction applies to rollout.placement=async only")
    if r.placement == "async":
        if cfg.engine.type != "hf":
            raise ConfigError(f"rollout.placement=async runs engine.type=hf engine processes; engine.type="
                              f"{cfg.engine.type!r} is not supported there yet (use placement=colocated)")
        if cfg.algorithm.dynamic_sampling:
            raise ConfigError("algorithm.dynamic_sampling (refills) needs rollout.placement=colocated; "
                              "async engine processes do not refill yet")
        if r.prompts_per_step % r.engine_ranks:
            raise ConfigError(f"rollout.prompts_per_step={r.prompts_per_step} is not divisible by "
                              f"rollout.engine_ranks={r.engine_ranks}")
        if cfg.data.image_field or cfg.data.video_field or cfg.data.audio_field:
            raise ConfigError("rollout.placement=async does not carry media prompts yet; use placement=colocated")
