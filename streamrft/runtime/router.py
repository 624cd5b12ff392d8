"""LearnerRouter: the AdvantageStage's outbox in an engine process (rollout.placement=async).

It has a ChannelSender's ``send`` and sends each sample to the learner rank that trains its prompt
group (``prompt_index % learner ranks``, so every learner rank gets the same number of groups of a
step), and every Control to all of them. The engine settles a sample by handing it off (the learner
counts it again when it arrives); the copy of ``end_of_step`` to learner rank 0 carries what the engine
settled by itself since its last report (filtered, failed, generated tokens) and when it was busy, so
the learner's accounting and overlap report cover the whole run.
"""

from __future__ import annotations

from collections import Counter

from protocols import Control, ScoredSample
from streamrft.runtime.accounting import Accounting


class LearnerRouter:
    def __init__(self, senders: list, accounting: Accounting, generator, engine_rank: int):
        self.senders = senders  # one ChannelSender per learner rank, in rank order
        self.accounting = accounting
        self.generator = generator  # its generated_tokens and busy intervals are reported
        self.engine_rank = engine_rank
        self._reported = {"admitted": 0, "filtered": Counter(), "failed": Counter()}

    async def send(self, header, tensors: dict | None = None, timeout: float | None = None) -> None:
        if isinstance(header, ScoredSample):
            learner = header.completion.prompt_index % len(self.senders)
            await self.senders[learner].send(header, tensors, timeout=timeout)
            self.accounting.hand_off(1, step=header.completion.step)
            return
        if isinstance(header, Control) and header.signal == "end_of_step":
            self.accounting.check_step(header.step)  # every sample of the step is handed off, filtered or failed
            _, firsts = self.accounting.take_step_failures(header.step)
            first = Control(signal="end_of_step", step=header.step, counts=self._report(), busy=self._busy(),
                            first_failures=dict(firsts))
            for rank, sender in enumerate(self.senders):
                await sender.send(first if rank == 0 else header, timeout=timeout)
            return
        for sender in self.senders:
            await sender.send(header, timeout=timeout)

    def _report(self) -> dict[str, int]:
        """Samples this engine settled itself (filtered, failed) since the last report, and the tokens
        it generated; the admitted count covers only those (handed-off samples are admitted on arrival)."""
        acct, last = self.accounting, self._reported
        counts: dict[str, int] = {}
        for kind in ("filtered", "failed"):
            now: Counter = getattr(acct, kind)
            for reason, n in (now - last[kind]).items():
                counts[f"{kind}/{reason}"] = n
            last[kind] = Counter(now)
        counts["admitted"] = sum(n for k, n in counts.items() if "/" in k)
        counts["generated_tokens"] = self.generator.generated_tokens
        self.generator.generated_tokens = 0
        return counts

    def _busy(self) -> list[float]:
        flat = [t for interval in self.generator.busy for t in interval]
        self.generator.busy.clear()
        return flat

    def close(self) -> None:
        for sender in self.senders:
            sender.close()
