"""The RolloutEngine interface: every engine (hf, vllm, sglang) implements exactly this."""

from __future__ import annotations

import asyncio
import time
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

    def new_tokens(self, default: int) -> int:
        """The most tokens to generate: this request's own ``max_new_tokens``, else the engine's ``default``."""
        return default if self.max_new_tokens is None else self.max_new_tokens


@dataclass
class GeneratedSample:
    request_id: str
    response_ids: list[int]
    # log-probs of the sampled tokens under the distribution actually sampled from
    # (after temperature, top-k, top-p); len == len(response_ids)
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    # the version the row started under (its first token's; the oldest of ``token_versions``)
    policy_version: int
    seconds: float = 0.0  # wall time from the batch start to this sample's end
    # per response token: the policy version that sampled it (len == len(response_ids); every engine fills
    # it); differs within a row only when a weight update lands mid-generation (hf with own_weights)
    token_versions: list[int] = field(default_factory=list)
    extras: dict = field(default_factory=dict)


class RolloutEngine(Protocol):
    """Every method the runtime calls on an engine (hf, vllm, sglang implement all of them; the runtime
    never probes an engine with hasattr/getattr)."""

    # the version of the weights the engine samples with now; tokens sampled from now on carry it
    policy_version: int
    # whether ``generate`` takes media prompts (``mm_inputs``): image / video / audio rows
    supports_media: bool

    def generate(self, requests: list[GenerationRequest], mm_inputs: dict | None = None) -> AsyncIterator[GeneratedSample]:
        """Yield each sample as soon as its own generation ends (not when the batch ends). ``mm_inputs``
        (request_id -> processor inputs) only where ``supports_media``."""
        ...

    async def generate_all(self, requests: list[GenerationRequest], mm_inputs: dict | None = None) -> list[GeneratedSample]:
        """All samples, in request order."""
        ...

    def with_config(self, cfg) -> "RolloutEngine":
        """Another engine over the same weights with other sampling settings (the greedy evaluation)."""
        ...

    def quiesce(self) -> None:
        """Return once no forward of a cancelled generate() is still running in a worker thread."""
        ...

    def close(self) -> None:
        """Release what the engine holds beyond the process (an in-process vLLM, a weights group)."""
        ...

    async def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1); also release or offload weights (level 2)."""
        ...

    async def wake(self) -> None: ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights (bucketed by the caller) and set ``policy_version = version``. The hf engine with
        ``own_weights`` also takes this while ``generate()`` runs (docs/engines.md, "In-flight weight
        updates"): then it may return with the version staged, not yet loaded; ``wait_version`` says when."""
        ...

    async def wait_version(self, version: int, timeout_s: float = 600.0) -> None:
        """Return once ``policy_version >= version`` (the weights of ``version`` are loaded and sample the next
        tokens); TimeoutError after ``timeout_s``."""
        ...


def check_requests(requests: list[GenerationRequest], max_new_tokens: int) -> None:
    """ValueError naming the request for what no engine can generate: a request id twice in one call (samples
    are matched back by id), an empty prompt, fewer than one new token (``max_new_tokens``: the engine's
    default for a request that sets none)."""
    seen: set[str] = set()
    for r in requests:
        if r.request_id in seen:
            raise ValueError(f"request_id {r.request_id!r} appears twice; request ids must be unique")
        seen.add(r.request_id)
        if not r.prompt_ids:
            raise ValueError(f"request {r.request_id!r} has an empty prompt; every prompt needs >= 1 token")
        n_new = r.new_tokens(max_new_tokens)
        if n_new < 1:
            raise ValueError(f"request {r.request_id!r} has max_new_tokens={n_new}; it must be >= 1")


async def wait_for_version(engine: RolloutEngine, version: int, timeout_s: float, staged: str = "") -> None:
    """``wait_version`` by polling ``engine.policy_version``: works from any thread's event loop and is
    cancellable (a threading.Condition wait in a worker thread would be neither). ``staged`` describes
    what the engine holds back, for the error."""
    deadline = time.monotonic() + timeout_s
    while engine.policy_version < version:
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine: the weights of version {version} are not loaded after {timeout_s:g}s (it "
                               f"samples with version {engine.policy_version}{staged}); was "
                               f"update_weights(..., {version}) called?")
        await asyncio.sleep(0.002)
