"""What every stage shares: its context (rank, timeouts, accounting, metrics) and an idle-aware inbox read."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from streamrft.runtime.accounting import Accounting


class StageError(RuntimeError):
    """A stage failed; the message names the stage and the rank."""


@dataclass
class StageContext:
    rank: int
    stage_timeout_s: float
    accounting: Accounting
    fail_fast: bool = False
    metrics: object | None = None  # PipelineMetrics or None
    # Set while the admission gate is open; an inbox that stays empty that long, with samples in flight,
    # is a hang.
    rollout_active: asyncio.Event = field(default_factory=asyncio.Event)


class Stage:
    """A coroutine with an inbox. Subclasses implement ``handle``; ``run`` reads the inbox forever."""

    name = "stage"

    def __init__(self, ctx: StageContext, inbox) -> None:
        self.ctx = ctx
        self.inbox = inbox

    async def recv(self):
        """Next message. A timeout while a rollout is active is an error naming stage and rank;
        while idle (between steps, during training) the stage keeps waiting."""
        from streamrft.runtime.channels import ChannelTimeout

        while True:
            try:
                item = await self.inbox.recv(timeout=self.ctx.stage_timeout_s)
            except ChannelTimeout:
                # a hang only while the gate is open and samples are in flight somewhere
                if self.ctx.rollout_active.is_set() and self.ctx.accounting.in_flight > 0:
                    raise StageError(
                        f"stage {self.name} on rank {self.ctx.rank}: no input for "
                        f"{self.ctx.stage_timeout_s:.0f}s during a rollout (rollout.stage_timeout_s); "
                        "an upstream stage is stuck"
                    ) from None
                continue
            if self.ctx.metrics is not None:
                self.ctx.metrics.queue_depth.labels(stage=self.name).set(self.inbox.qsize())
            return item

    def observe_latency(self, started: float) -> None:
        if self.ctx.metrics is not None:
            self.ctx.metrics.stage_latency.labels(stage=self.name).observe(time.perf_counter() - started)

    async def run(self) -> None:
        while True:
            header, tensors = await self.recv()
            stop = await self.handle(header, tensors)
            if stop:
                return

    async def handle(self, header, tensors) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError
