"""LearnerFeed: the learner's inbox. Collects a step's samples; the PhaseController waits on it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from protocols import Control, ScoredSample
from streamrft.runtime.stage import Stage, StageContext


@dataclass
class TrainSample:
    header: ScoredSample
    prompt_ids: torch.Tensor  # (P,) int64
    response_ids: torch.Tensor  # (R,) int64
    behaviour_logprobs: torch.Tensor  # (R,) float32
    advantages: torch.Tensor | None  # (R,) float32; None = computed by the learner (batch scope)
    teacher_logprobs: torch.Tensor | None = None  # (R,) float32


class LearnerFeed(Stage):
    name = "learner_feed"

    def __init__(self, ctx: StageContext, inbox, max_staleness: int, policy_version_fn):
        super().__init__(ctx, inbox)
        self.max_staleness = max_staleness
        self.policy_version_fn = policy_version_fn
        self.samples: dict[int, list[TrainSample]] = {}
        self.ready: dict[int, asyncio.Future] = {}

    def _future(self, step: int) -> asyncio.Future:
        if step not in self.ready:
            self.ready[step] = asyncio.get_running_loop().create_future()
        return self.ready[step]

    async def handle(self, header, tensors) -> bool:
        if isinstance(header, Control):
            if header.signal == "end_of_step":
                self._future(header.step).set_result(self.samples.pop(header.step, []))
            return header.signal == "stop"
        staleness = self.policy_version_fn() - header.completion.policy_version
        if self.ctx.metrics is not None:
            self.ctx.metrics.staleness.observe(staleness)
        if staleness > self.max_staleness:
            self.ctx.accounting.filter("stale")
            return False
        self.samples.setdefault(header.completion.step, []).append(
            TrainSample(
                header=header,
                prompt_ids=tensors["prompt_ids"],
                response_ids=tensors["response_ids"],
                behaviour_logprobs=tensors["behaviour_logprobs"],
                advantages=tensors.get("advantages"),
                teacher_logprobs=tensors.get("teacher_logprobs"),
            )
        )
        return False

    async def wait_batch(self, step: int) -> list[TrainSample]:
        batch = await self._future(step)
        del self.ready[step]
        return batch
