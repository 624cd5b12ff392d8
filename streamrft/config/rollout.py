from __future__ import annotations

from streamrft.config.base import Section


class RolloutConfig(Section):
    n_samples_per_prompt: int = 8  # samples per prompt group
    prompts_per_step: int = 16  # global prompt groups per train step (across all ranks)
    max_staleness: int = 1  # drop samples more than this many policy versions old
    channel_capacity: int = 256  # credits of each stage inbox (bounds memory and staleness)
    stage_timeout_s: float = 600.0  # any wait longer than this is an error naming stage and rank
    channel_transport: str = "inproc"  # inproc | ipc | tcp, for the in-rank stage channels
