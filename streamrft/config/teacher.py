from __future__ import annotations

from typing import Literal

from streamrft.config.base import Section


class TeacherConfig(Section):
    type: Literal["none", "streamrft", "sglang", "vllm"] = "none"
    address: str = ""  # tcp://host:port (streamrft) or http://host:port (sglang / vllm)
    mode: Literal["pure", "hybrid"] = "pure"  # pure: advantage = teacher - student log-prob
    weight: float = 1.0  # hybrid: weight of the distillation advantage beside the task reward
