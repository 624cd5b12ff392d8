"""Wires one rank's stages with credit-based channels and supervises them.

    Generator ─► RewardScorer ─► TeacherFetcher ─► AdvantageStage ─► LearnerFeed
        ▲                                              │ group_done (kept / filtered)
        └──────────────────────────────────────────────┘

The TeacherFetcher hop exists only with a teacher (on-policy distillation); without one the scorer
sends straight to the AdvantageStage (every hop costs each sample a send, a receive and a task).

A stage task that dies stops the run with the stage and rank in the message.
"""

from __future__ import annotations

import asyncio
import uuid

from protocols import Completion, Control, ScoredSample
from streamrft.runtime.advantage_stage import AdvantageStage
from streamrft.runtime.channels import ChannelReceiver, ChannelSender, channel_address
from streamrft.runtime.feed import LearnerFeed, TrainSample
from streamrft.runtime.generator import Generator
from streamrft.runtime.scoring import RewardScorerStage, TeacherFetcherStage
from streamrft.runtime.stage import StageContext, StageError


class Pipeline:
    def __init__(self, cfg, ctx: StageContext, world_size: int, engine, tokenizer, dataset, scorer, teacher=None, run_id: str | None = None, policy_version_fn=lambda: 0):
        self.cfg, self.ctx, self.world_size = cfg, ctx, world_size
        self.engine, self.tokenizer, self.dataset, self.scorer, self.teacher = engine, tokenizer, dataset, scorer, teacher
        self.policy_version_fn = policy_version_fn
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self._sockets: list = []
        self.stages: list = []
        self.generator: Generator | None = None
        self.feed: LearnerFeed | None = None
        self.advantage: AdvantageStage | None = None
        self.tasks: dict[asyncio.Task, str] = {}

    def _link(self, name: str, message_type) -> tuple[ChannelReceiver, ChannelSender]:
        cfg, rank = self.cfg.rollout, self.ctx.rank
        address = channel_address(cfg.channel_transport, name, rank, self.run_id)
        receiver = ChannelReceiver(address, cfg.channel_capacity, name=name, rank=rank, message_type=message_type)
        sender = ChannelSender(receiver.address, name=name, rank=rank)
        self._sockets += [sender, receiver]
        return receiver, sender

    async def start(self) -> None:
        """Create channels and stage tasks. Runs inside the event loop: receivers answer credit
        handshakes from the loop they were created in."""
        cfg, ctx = self.cfg, self.ctx
        reward_in, to_reward = self._link("reward", Completion | Control)
        advantage_in, to_advantage = self._link("advantage", ScoredSample | Control)
        feed_in, to_feed = self._link("learner_feed", ScoredSample | Control)
        feedback_in, to_generator = self._link("generator_feedback", Control)
        self.generator = Generator(ctx, feedback_in, to_reward, self.engine, self.tokenizer, self.dataset, cfg, self.world_size)
        self.feed = LearnerFeed(ctx, feed_in, cfg.rollout.max_staleness, self.policy_version_fn)
        self.advantage = AdvantageStage(ctx, advantage_in, to_feed, to_generator, cfg)
        if self.teacher is None:
            self.stages = [RewardScorerStage(ctx, reward_in, to_advantage, self.scorer, cfg.reward.max_concurrency)]
        else:
            teacher_in, to_teacher = self._link("teacher", ScoredSample | Control)
            self.stages = [
                RewardScorerStage(ctx, reward_in, to_teacher, self.scorer, cfg.reward.max_concurrency),
                TeacherFetcherStage(ctx, teacher_in, to_advantage, self.teacher, cfg.reward.max_concurrency),
            ]
        self.stages += [self.advantage, self.feed]
        for stage in self.stages:
            task = asyncio.create_task(stage.run(), name=f"{stage.name}-rank{ctx.rank}")
            self.tasks[task] = stage.name

    def _check_stages(self) -> None:
        for task, name in self.tasks.items():
            if task.done():
                exc = task.exception() if not task.cancelled() else None
                if isinstance(exc, StageError):
                    raise exc
                raise StageError(f"stage {name} on rank {self.ctx.rank} stopped: {exc!r}") from exc

    async def run_step(self, step: int) -> list[TrainSample]:
        """Roll out one step on this rank and return its train samples once the batch is complete."""
        self.ctx.rollout_active.set()
        generate = asyncio.create_task(self.generator.run_step(step), name=f"generator-rank{self.ctx.rank}")
        batch = asyncio.create_task(self.feed.wait_batch(step), name=f"batch-rank{self.ctx.rank}")
        try:
            pending = {generate, batch, *self.tasks}
            while not batch.done():
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if generate in done:
                    pending.discard(generate)
                    if generate.exception() is not None:
                        raise StageError(f"stage generator on rank {self.ctx.rank} failed: {generate.exception()}") from generate.exception()
                self._check_stages()
            await generate
            return batch.result()
        finally:
            self.ctx.rollout_active.clear()
            for task in (generate, batch):
                if not task.done():
                    task.cancel()
                    # Its late exception (ChannelClosed at shutdown) is expected: mark it retrieved.
                    task.add_done_callback(lambda t: t.cancelled() or t.exception())

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
