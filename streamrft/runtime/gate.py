"""AdmissionGate: the one place that decides when the Generator may admit another prompt group.

A group planned for train step ``k`` may be admitted while the engine generates with policy version
``v`` only if

    groups in flight < max_groups_in_flight        (memory: bounded by the channel credits)
    k - v <= rollout.max_staleness                  (staleness: step k trains at learner version k)
    the gate is open                                (colocated: closed while the learner trains)

so a sample is never more than ``max_staleness`` versions behind the learner that trains it.
``max_staleness=0`` admits step k only once the weights of version k are loaded: the step-synchronous
loop. A group stays "in flight" from admission until the AdvantageStage reports it kept or filtered
(``group_done``), which the Generator consumes while it is still generating, so no capacity setting can
deadlock the gate.
"""

from __future__ import annotations

import asyncio


def max_groups_in_flight(channel_capacity: int, n_samples_per_prompt: int, groups_per_step: int = 1) -> int:
    """Groups admitted but not yet resolved: as many whole groups as one stage inbox holds, and never fewer
    than one step's groups on this rank, so a step is generated as one batch (decode efficiency on GPUs,
    as the step loop did); the channels' credits then pace the samples downstream."""
    return max(1, channel_capacity // n_samples_per_prompt, groups_per_step)


class AdmissionGate:
    def __init__(self, max_staleness: int, max_in_flight: int, version: int = 0, metrics=None):
        if max_staleness < 0:
            raise ValueError(f"rollout.max_staleness={max_staleness} must be >= 0")
        self.max_staleness = max_staleness
        self.max_in_flight = max_in_flight
        self.version = version  # the policy version the engine generates with
        self.in_flight = 0  # groups admitted and not yet resolved
        self.open = False  # colocated: closed while the learner owns the devices
        self.metrics = metrics
        self._changed = asyncio.Condition()

    def blocked_by(self, step: int) -> str:
        """Why a group of ``step`` cannot be admitted now ("" = it can)."""
        if not self.open:
            return "paused"
        if self.in_flight >= self.max_in_flight:
            return "in_flight"
        if step - self.version > self.max_staleness:
            return "staleness"
        return ""

    def room(self) -> int:
        return max(self.max_in_flight - self.in_flight, 0)

    async def wait_admissible(self, step: int) -> int:
        """Wait until at least one group of ``step`` may be admitted; return how many may."""
        async with self._changed:
            while reason := self.blocked_by(step):
                self._export(step, reason)
                await self._changed.wait()
        self._export(step, "")
        return self.room()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def admit(self, groups: int) -> None:
        self.in_flight += groups
        self._export(None, None)

    async def release(self, groups: int = 1) -> None:
        self.in_flight -= groups
        self._export(None, None)
        await self._notify()

    async def set_version(self, version: int) -> None:
        self.version = version
        await self._notify()

    async def set_open(self, is_open: bool) -> None:
        self.open = is_open
        await self._notify()

    def _export(self, step: int | None, blocked: str | None) -> None:
        m = self.metrics
        if m is None:
            return
        m.admission_in_flight_groups.set(self.in_flight)
        if blocked is not None:
            for reason in ("paused", "in_flight", "staleness"):
                m.admission_blocked.labels(reason=reason).set(1.0 if reason == blocked else 0.0)
