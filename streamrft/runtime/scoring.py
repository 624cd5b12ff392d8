"""RewardScorer and TeacherFetcher stages: each sample is scored as soon as its own generation ends.

Scoring runs as one task per sample (bounded by ``reward.max_concurrency``), so a slow reward source
overlaps generation instead of serialising it. Samples that are already waiting together in the reward
stage's inbox (a decode block that finishes many at once) are scored by one task and one scorer call, at
most ``SCORE_BATCH`` of them: a task, a thread hand-off and a message per sample were much of the event
loop's time in the per-sample tail (benchmarks/tail_bench.py, NOTES.md v15). A failed score fails that sample, counted with its
reason; under ``fail_fast`` it stops the run.
"""

from __future__ import annotations

import asyncio
import math
import time

from protocols import Completion, Control, RewardItem, ScoredSample
from streamrft.runtime.stage import Stage, StageContext, StageError

SCORE_BATCH = 64  # samples scored by one call at most (a remote source gets requests of at most this many)


class _ConcurrentStage(Stage):
    """A stage that handles each sample in its own task and forwards end_of_step after they finish."""

    batch_limit = 1  # items already waiting together that one task handles (RewardScorerStage: SCORE_BATCH)

    def __init__(self, ctx: StageContext, inbox, outbox, max_concurrency: int):
        super().__init__(ctx, inbox)
        self.outbox = outbox
        self.slots = asyncio.Semaphore(max_concurrency)
        self.tasks: set[asyncio.Task] = set()
        self.failure: asyncio.Future | None = None  # the first item task's exception stops the stage

    def _on_item_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and not self.failure.done():
            self.failure.set_exception(task.exception())

    def _reap(self) -> None:
        for task in [t for t in self.tasks if t.done()]:
            self.tasks.discard(task)
        if self.failure is not None and self.failure.done():
            raise self.failure.exception()

    async def run(self) -> None:
        """Like Stage.run, but an item task that fails stops the stage at once, not at the next message."""
        self.failure = asyncio.get_running_loop().create_future()
        held = None  # a control message read while collecting a batch: handled right after it
        while True:
            if held is not None:
                (header, tensors), held = held, None
            elif self.inbox.qsize() and not self.failure.done():
                # a message is already here: take it without a task and a wait (bursts: a whole step's
                # samples can arrive at once)
                header, tensors = await self.recv()
            else:
                header, tensors = await self._recv_or_fail()
            if isinstance(header, Control) or self.batch_limit == 1:
                if await self.handle(header, tensors):
                    return
                continue
            batch = [(header, tensors)]
            while len(batch) < self.batch_limit and self.inbox.qsize() and not self.failure.done():
                item = await self.recv()
                if isinstance(item[0], Control):
                    held = item
                    break
                batch.append(item)
            await self.handle_batch(batch)

    async def handle_batch(self, batch: list) -> None:
        """Several items already waiting together, in one task (stages with ``batch_limit`` > 1)."""
        self._reap()
        await self.slots.acquire()
        task = asyncio.create_task(self._process_batch_released(batch), name=f"{self.name}-batch")
        task.add_done_callback(self._on_item_done)
        self.tasks.add(task)

    async def _process_batch_released(self, batch: list) -> None:
        try:
            await self.process_batch(batch)
        finally:
            self.slots.release()

    async def process_batch(self, batch: list) -> None:
        for header, tensors in batch:
            await self.process(header, tensors)

    async def _recv_or_fail(self):
        """The next message, or the first item task's exception, whichever comes first."""
        receive = asyncio.ensure_future(self.recv())
        try:
            await asyncio.wait({receive, self.failure}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not receive.done():
                receive.cancel()
                # At shutdown its late ChannelClosed is expected: mark it retrieved.
                receive.add_done_callback(lambda t: t.cancelled() or t.exception())
        if self.failure.done():
            receive.cancel()
            for task in self.tasks:
                task.cancel()
            raise self.failure.exception()
        return receive.result()

    async def handle(self, header, tensors) -> bool:
        self._reap()
        if isinstance(header, Control):
            if self.tasks:
                await asyncio.gather(*self.tasks, return_exceptions=True)
            self._reap()
            await self.outbox.send(header, timeout=self.ctx.stage_timeout_s)
            return header.signal == "stop"
        await self.slots.acquire()
        task = asyncio.create_task(self._process_released(header, tensors), name=f"{self.name}-item")
        task.add_done_callback(self._on_item_done)
        self.tasks.add(task)
        return False

    async def _process_released(self, header, tensors) -> None:
        try:
            await self.process(header, tensors)
        finally:
            self.slots.release()

    async def process(self, header, tensors) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


def _images_of(completion: Completion) -> list[str]:
    """The sample's images for reward sources (base64, each distinct image encoded once)."""
    if not any(ref.kind == "image" for ref in completion.media):
        return []
    from streamrft.data.media import encode_images_once

    return encode_images_once(completion.media)


class RewardScorerStage(_ConcurrentStage):
    name = "reward"
    batch_limit = SCORE_BATCH

    def __init__(self, ctx: StageContext, inbox, outbox, scorer, max_concurrency: int):
        super().__init__(ctx, inbox, outbox, max_concurrency)
        self.scorer = scorer

    async def process(self, completion: Completion, tensors) -> None:
        await self.process_batch([(completion, tensors)])

    async def process_batch(self, batch: list[tuple[Completion, dict]]) -> None:
        started = time.perf_counter()
        scored: list[ScoredSample | None] = [None] * len(batch)
        by_step: dict[int, list[int]] = {}  # the failure policy tallies per train step (several may be in flight)
        for i, (completion, _) in enumerate(batch):
            if completion.error:  # failed before scoring (an environment that raised): counted downstream, not scored
                scored[i] = ScoredSample(completion=completion, reward=0.0, status="failed",
                                         fail_reason=completion.error)
            else:
                by_step.setdefault(completion.step, []).append(i)
        for step, picked in by_step.items():
            items = [_reward_item(batch[i][0]) for i in picked]
            outcomes = await self.scorer.score(items, step=step)
            for i, outcome in zip(picked, outcomes):
                scored[i] = self._scored(batch[i][0], outcome, started)
        for (_, tensors), sample in zip(batch, scored):
            await self.outbox.send(sample, tensors, timeout=self.ctx.stage_timeout_s)

    def _scored(self, completion: Completion, outcome, started: float) -> ScoredSample:
        error = outcome.error
        if not error and not math.isfinite(outcome.reward):
            error = f"non-finite reward {outcome.reward}"
        if error and self.ctx.fail_fast:
            raise StageError(
                f"stage reward on rank {self.ctx.rank}: sample {completion.sample_id} failed: {error} (fail_fast: true)"
            )
        components = {k: float(v) for k, v in outcome.components.items()}
        reward = 0.0 if error else float(outcome.reward)
        if completion.turns and not error:
            # multi-turn: the environment's per-turn rewards add to the reward sources' final reward
            # (docs/agents.md; batch estimators credit each at its turn's last model token instead)
            components["env_turns"] = float(sum(completion.turn_rewards))
            reward += components["env_turns"]
        self.observe_latency(started)
        return ScoredSample(
            completion=completion,
            reward=reward,
            reward_components=components,
            status="failed" if error else "ok",
            fail_reason=f"reward: {error}" if error else "",
            score_seconds=time.perf_counter() - started,
        )


def _reward_item(completion: Completion) -> RewardItem:
    return RewardItem(
        sample_id=completion.sample_id,
        prompt=completion.prompt_text,
        response=completion.response_text,
        reference=completion.reference,
        label=completion.label,
        images=_images_of(completion),
        columns=completion.columns,
        media=list(completion.media),  # by reference: a media reward model reads the files (hash-checked)
    )


class TeacherFetcherStage(_ConcurrentStage):
    """Adds ``teacher_logprobs`` from a remote teacher (on-policy distillation); without a teacher it
    passes samples straight through."""

    name = "teacher"

    def __init__(self, ctx: StageContext, inbox, outbox, teacher=None, max_concurrency: int = 16):
        super().__init__(ctx, inbox, outbox, max_concurrency)
        self.teacher = teacher

    async def process(self, scored: ScoredSample, tensors) -> None:
        if self.teacher is not None and scored.status == "ok":
            started = time.perf_counter()
            try:
                tensors["teacher_logprobs"] = await self.teacher.logprobs(
                    tensors["prompt_ids"], tensors["response_ids"]
                )
            except Exception as exc:  # counted as a failed sample, never swallowed
                if self.ctx.fail_fast:
                    raise StageError(f"stage teacher on rank {self.ctx.rank}: {exc}") from exc
                scored.status, scored.fail_reason = "failed", f"teacher: {exc}"
            self.observe_latency(started)
        await self.outbox.send(scored, tensors, timeout=self.ctx.stage_timeout_s)
