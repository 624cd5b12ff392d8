"""Wires one rank's stages with credit-based channels and supervises them. The stages live for the
whole run; the driver takes one step's batch at a time (``take``) and opens or closes the admission
gate around the learner's use of the devices (``pause`` / ``resume``).

    Generator ─► RewardScorer ─► TeacherFetcher ─► AdvantageStage ─► LearnerFeed
        ▲                                              │ group_done (kept / filtered)
        └──────────────────────────────────────────────┘

The TeacherFetcher hop exists only with a teacher (on-policy distillation); without one the scorer
sends straight to the AdvantageStage (every hop costs each sample a send, a receive and a task).

A stage task that dies stops the run with the stage and rank in the message.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import uuid

from protocols import Completion, Control, ScoredSample
from streamrft.runtime.advantage_stage import AdvantageStage
from streamrft.runtime.channels import ChannelReceiver, ChannelSender, channel_address
from streamrft.runtime.feed import LearnerFeed, TrainBatch
from streamrft.runtime.gate import AdmissionGate, max_groups_in_flight
from streamrft.runtime.generator import Generator
from streamrft.runtime.scoring import RewardScorerStage, TeacherFetcherStage
from streamrft.runtime.stage import StageContext, StageError


def _compiles_finished() -> int:
    from streamrft.learner.compiling import compiles_finished  # torch-side module: imported when first needed

    return compiles_finished()


class Pipeline:
    def __init__(self, cfg, ctx: StageContext, world_size: int, engine, tokenizer, dataset, scorer, teacher=None, run_id: str | None = None):
        self.cfg, self.ctx, self.world_size = cfg, ctx, world_size
        self.engine, self.tokenizer, self.dataset, self.scorer, self.teacher = engine, tokenizer, dataset, scorer, teacher
        r = cfg.rollout
        self.gate = AdmissionGate(r.max_staleness, max_groups_in_flight(r.channel_capacity, r.n_samples_per_prompt,
                                                                        r.prompts_per_step // world_size),
                                  metrics=ctx.metrics)
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self._sockets: list = []
        self.stages: list = []
        self.generator: Generator | None = None
        self.feed: LearnerFeed | None = None
        self.advantage: AdvantageStage | None = None
        self._compiles_frozen = 0  # compiles_finished() when the heap was last frozen
        self.tasks: dict[asyncio.Task, str] = {}

    def _link(self, name: str, message_type) -> tuple[ChannelReceiver, ChannelSender]:
        cfg, rank = self.cfg.rollout, self.ctx.rank
        address = channel_address(cfg.channel_transport, name, rank, self.run_id)
        receiver = ChannelReceiver(address, cfg.channel_capacity, name=name, rank=rank, message_type=message_type)
        sender = ChannelSender(receiver.address, name=name, rank=rank)
        self._sockets += [sender, receiver]
        return receiver, sender

    async def start(self) -> None:
        """Create channels and stages, not yet their tasks (``launch``). Runs inside the event loop:
        receivers answer credit handshakes from the loop they were created in."""
        cfg, ctx = self.cfg, self.ctx
        reward_in, to_reward = self._link("reward", Completion | Control)
        advantage_in, to_advantage = self._link("advantage", ScoredSample | Control)
        feed_in, to_feed = self._link("learner_feed", ScoredSample | Control)
        feedback_in, to_generator = self._link("generator_feedback", Control)
        self.generator = Generator(ctx, feedback_in, to_reward, self.engine, self.tokenizer, self.dataset, cfg, self.world_size,
                                   self.gate)
        self.feed = LearnerFeed(ctx, feed_in, cfg.rollout.max_staleness, cfg.rollout.stale_policy)
        self.advantage = AdvantageStage(ctx, advantage_in, to_feed, to_generator, cfg)
        if self.teacher is None:
            self.stages = [RewardScorerStage(ctx, reward_in, to_advantage, self.scorer, cfg.reward.max_concurrency)]
        else:
            teacher_in, to_teacher = self._link("teacher", ScoredSample | Control)
            self.stages = [
                RewardScorerStage(ctx, reward_in, to_teacher, self.scorer, cfg.reward.max_concurrency),
                TeacherFetcherStage(ctx, teacher_in, to_advantage, self.teacher, cfg.reward.max_concurrency),
            ]
        self.stages += [self.advantage, self.feed, self.generator]

    def launch(self, start_step: int) -> None:
        """Start every stage's task; the Generator plans from ``start_step`` on (a resumed run starts
        after its checkpoint). The gate stays closed until ``resume``."""
        self.generator.start_step = start_step
        # Everything alive now (modules, engine, tokenizer, imported code: ~400k objects for the tiny CPU
        # model) lives for the whole run; out of the collector's full passes it no longer makes each
        # generation-2 collection walk it: those passes cost 0.24 s each inside a rollout of 512 samples
        # (one step in three), 0.02-0.03 s frozen (benchmarks/NOTES.md, "v7: the rollout tail on CPU").
        # Frozen objects are still freed by reference counting; stop() unfreezes them. Compiles later in the
        # run add theirs (step_trained).
        gc.freeze()
        self._compiles_frozen = _compiles_finished()
        for stage in self.stages:
            task = asyncio.create_task(stage.run(), name=f"{stage.name}-rank{self.ctx.rank}")
            self.tasks[task] = stage.name

    def _check_stages(self) -> None:
        for task, name in self.tasks.items():
            if task.done():
                exc = task.exception() if not task.cancelled() else None
                if isinstance(exc, StageError):
                    raise exc
                raise StageError(f"stage {name} on rank {self.ctx.rank} stopped: {exc!r}") from exc

    async def take(self, step: int, learner_version: int) -> TrainBatch:
        """This rank's batch of ``step`` once every stage has delivered it, watching every stage task:
        one that dies stops the wait with its name and rank."""
        return await self._watched(self.feed.take(step, learner_version), f"take-rank{self.ctx.rank}")

    async def _watched(self, coro, name: str):
        """Await ``coro`` while watching every stage task: one that dies ends the wait with its error."""
        task = asyncio.create_task(coro, name=name)
        try:
            while not task.done():
                await asyncio.wait({task, *self.tasks}, return_when=asyncio.FIRST_COMPLETED)
                self._check_stages()
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                # its late exception (ChannelClosed at shutdown) is expected: mark it retrieved
                task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def pause(self) -> None:
        """Close the gate and wait until no generate call runs (the learner needs the devices, or the
        evaluation needs the engine)."""
        await self.gate.set_open(False)
        self.ctx.rollout_active.clear()
        await self._watched(self.generator.wait_idle(self.ctx.stage_timeout_s), f"drain-rank{self.ctx.rank}")

    @contextlib.asynccontextmanager
    async def hold(self):
        """Admission paused (no generate call running) inside the block, reopened as it was after."""
        was_open = self.gate.open
        await self.pause()
        try:
            yield
        finally:
            if was_open:
                await self.resume(self.gate.version)

    async def resume(self, version: int) -> None:
        """The engine generates with ``version`` now: open the gate for the steps it allows."""
        self.ctx.rollout_active.set()
        await self.gate.set_version(version)
        await self.gate.set_open(True)
        await self.generator.reopened()

    def stateful(self) -> dict:
        """Per-rank objects a checkpoint keeps (the Generator's refill counter)."""
        return {"generator": self.generator}

    def step_trained(self, step: int) -> None:
        self.generator.forget_through(step)
        self._freeze_what_compiles_left()

    def _freeze_what_compiles_left(self) -> None:
        """After a step that compiled (the first train step with train.compile_layers / compile_head, or a new
        shape), freeze its long-lived objects too: Dynamo's graphs, guards and symbolic expressions made every
        later full collection walk them (CPU tail_bench with compiled layers: 0.25 s passes inside one rollout
        in two, benchmarks/NOTES.md v9). The young generations are collected first, so the compile's
        short-lived cycles are freed rather than frozen."""
        compiles = _compiles_finished()
        if compiles != self._compiles_frozen:
            gc.collect(1)
            gc.freeze()
            self._compiles_frozen = compiles

    def take_generated_tokens(self) -> int:
        tokens, self.generator.generated_tokens = self.generator.generated_tokens, 0
        return tokens

    def media_codec(self):
        return self.generator.media if self.generator is not None else None

    def take_dropped(self) -> list:
        """Failed and filtered samples since the last call: (ScoredSample, tensors, status, reason)."""
        if self.advantage is None:
            return []
        dropped, self.advantage.dropped = self.advantage.dropped, []
        return dropped

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every stage and close every socket (linger 0): nothing is left behind.

        Sockets close before the tasks are awaited, so a stage blocked in recv gets ChannelClosed
        even if its cancellation was swallowed (asyncio.wait_for in Python 3.11 can lose a cancel
        that races with its inner future)."""
        gc.unfreeze()  # what launch() froze is collectable again (cycles among it are freed)
        for task in self.tasks:
            task.cancel()
        for sock in self._sockets:
            sock.close()
        if self.tasks:
            done, pending = await asyncio.wait(self.tasks, timeout=timeout_s)
            for task in done:
                if not task.cancelled():
                    task.exception()  # retrieved: the run already reported the first failure
            if pending:
                names = sorted(self.tasks[t] for t in pending)
                raise StageError(f"rank {self.ctx.rank}: stages {names} did not stop within {timeout_s}s")
        self.tasks.clear()
