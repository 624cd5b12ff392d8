"""LearnerFeed: the learner's inbox, a version-aware buffer with a collective ``take``.

Samples arrive grouped by the step they were planned for; a step is complete on this rank when its
``end_of_step`` arrived from every upstream sender (one Generator per rank colocated; every engine
process in the async placement). ``take(step, learner_version)`` waits for that, applies the staleness
rule to each sample (its oldest token's version against the learner's), orders the samples
canonically (by prompt, then sample index: arrival order varies from run to run, summation order must
not) and returns a typed ``TrainBatch``. The driver then agrees on the global batch with one all-reduce
(PhaseController.batch_ready): that is what makes the take collective.

Staleness rule (``rollout.stale_policy``): ``drop`` filters a sample more than ``rollout.max_staleness``
versions behind and counts it ("stale"); ``wait`` relies on the admission gate alone (admission waits,
so nothing can become stale) and treats a stale sample at take time as an error, never training it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from protocols import Control, ScoredSample
from streamrft.runtime.stage import Stage, StageContext, StageError


@dataclass
class TrainSample:
    header: ScoredSample
    prompt_ids: torch.Tensor  # (P,) int64
    response_ids: torch.Tensor  # (R,) int64
    behaviour_logprobs: torch.Tensor  # (R,) float32
    advantages: torch.Tensor | None  # (R,) float32; None = computed by the learner (batch scope)
    teacher_logprobs: torch.Tensor | None = None  # (R,) float32
    token_versions: torch.Tensor | None = None  # (R,) int64: the policy version that sampled each token
    loss_mask: torch.Tensor | None = None  # (R,) uint8, multi-turn: 1 = model token, 0 = observation; None = all 1

    @property
    def oldest_version(self) -> int:
        if self.token_versions is None or not len(self.token_versions):
            return self.header.completion.policy_version
        return int(self.token_versions.min())

    @property
    def order_key(self) -> tuple[int, int, str]:
        c = self.header.completion
        return (c.prompt_index, c.sample_index, c.sample_id)


@dataclass
class TrainBatch:
    """What one train step takes on this rank: its samples in canonical order, and what was dropped."""

    step: int
    learner_version: int
    samples: list[TrainSample]
    stale: list[TrainSample] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self):
        return iter(self.samples)

    def versions_behind(self) -> list[int]:
        """Per trained sample: learner version minus its oldest token's version."""
        return [self.learner_version - s.oldest_version for s in self.samples]


class LearnerFeed(Stage):
    name = "learner_feed"

    def __init__(self, ctx: StageContext, inbox, max_staleness: int, stale_policy: str = "drop", senders: int = 1):
        super().__init__(ctx, inbox)
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.senders = senders  # end_of_step messages that complete a step
        self.samples: dict[int, list[TrainSample]] = {}
        self.ends: dict[int, int] = {}
        self.ready: dict[int, asyncio.Future] = {}

    def _future(self, step: int) -> asyncio.Future:
        if step not in self.ready:
            self.ready[step] = asyncio.get_running_loop().create_future()
        return self.ready[step]

    def buffered(self) -> int:
        return sum(len(v) for v in self.samples.values())

    async def handle(self, header, tensors) -> bool:
        if isinstance(header, Control):
            if header.signal == "end_of_step":
                self.ends[header.step] = self.ends.get(header.step, 0) + 1
                if self.ends[header.step] == self.senders:
                    del self.ends[header.step]
                    self._future(header.step).set_result(self.samples.pop(header.step, []))
            return header.signal == "stop"
        self.samples.setdefault(header.completion.step, []).append(
            TrainSample(
                header=header,
                prompt_ids=tensors["prompt_ids"],
                response_ids=tensors["response_ids"],
                behaviour_logprobs=tensors["behaviour_logprobs"],
                advantages=tensors.get("advantages"),
                teacher_logprobs=tensors.get("teacher_logprobs"),
                token_versions=tensors.get("token_versions"),
                loss_mask=tensors.get("loss_mask"),
            )
        )
        return False

    async def take(self, step: int, learner_version: int) -> TrainBatch:
        """This rank's samples of ``step``, once complete, after the staleness rule, in canonical order."""
        samples = await self._future(step)
        del self.ready[step]
        batch = TrainBatch(step=step, learner_version=learner_version, samples=[])
        for sample in sorted(samples, key=lambda s: s.order_key):
            behind = learner_version - sample.oldest_version
            if self.ctx.metrics is not None:
                self.ctx.metrics.staleness.observe(behind)
            if behind <= self.max_staleness:
                batch.samples.append(sample)
            elif self.stale_policy == "wait":
                raise StageError(
                    f"stage learner_feed on rank {self.ctx.rank}: sample {sample.header.completion.sample_id} is "
                    f"{behind} versions behind learner version {learner_version} (rollout.max_staleness="
                    f"{self.max_staleness}, rollout.stale_policy=wait: the admission gate should have held it back)")
            else:
                self.ctx.accounting.filter("stale", step=step)
                batch.stale.append(sample)
        return batch
