"""The RolloutEngine interface: every engine (hf, vllm, sglang) implements exactly this."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Iterable, Protocol

import torch


@dataclass
class GenerationRequest:
    """One sequence to sample. ``seed`` is derived from (run seed, step, prompt index, sample index),
    so a sample's tokens do not depend on batch composition or on how many ranks there are."""

    request_id: str
    prompt_ids: list[int]
    seed: int
    max_new_tokens: int | None = None  # None = engine config


@dataclass
class GeneratedSample:
    request_id: str
    response_ids: list[int]
    # log-probs of the sampled tokens under the distribution actually sampled from
    # (after temperature, top-k, top-p); len == len(response_ids)
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    policy_version: int
    seconds: float = 0.0  # wall time from the batch start to this sample's end
    # per response token: the policy version that sampled it ([] = all ``policy_version``); differs within a
    # row only when a weight update lands mid-generation
    token_versions: list[int] = field(default_factory=list)
    extras: dict = field(default_factory=dict)


class RolloutEngine(Protocol):
    policy_version: int

    def generate(self, requests: list[GenerationRequest]) -> AsyncIterator[GeneratedSample]:
        """Yield each sample as soon as its own generation ends (not when the batch ends)."""
        ...

    async def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1); also release or offload weights (level 2)."""
        ...

    async def wake(self) -> None: ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights (bucketed by the caller) and set ``policy_version = version``."""
        ...
