"""Sample accounting: every admitted sample ends trained, filtered (with reason) or failed (with reason)."""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field


class AccountingError(RuntimeError):
    """Samples were lost or double-counted: admitted != trained + filtered + failed."""


@dataclass
class Accounting:
    rank: int = 0
    admitted: int = 0
    trained: int = 0
    filtered: Counter = field(default_factory=Counter)  # reason -> samples
    failed: Counter = field(default_factory=Counter)  # reason -> samples
    refilled_prompts: int = 0
    handed_off: int = 0  # async engine processes: samples sent on to a learner rank (it trains or drops them)
    metrics: object | None = None  # PipelineMetrics, when exported
    # Per planned step: samples admitted and not yet settled. Steps overlap when rollout.max_staleness > 0
    # (the next step's groups are generated while this one trains), so the end-of-step check is per step.
    open_by_step: Counter = field(default_factory=Counter)
    # Per planned step, until the failure policy takes it (take_step_failures): failed samples by kind and
    # the first full reason of each kind, for the console line and the stop message.
    step_failures: dict = field(default_factory=dict)  # step -> (Counter kind -> n, {kind: first reason})

    def _open(self, step: int | None, n: int) -> None:
        if step is not None:
            self.open_by_step[step] += n
            if not self.open_by_step[step]:
                del self.open_by_step[step]

    def _together(self):
        """Each count and its exported counter change under the scrape lock, so a scrape (whose probe
        derives in_flight{stage="pipeline"} from these counts) never sees one without the other."""
        return self.metrics.atomic() if self.metrics is not None else contextlib.nullcontext()

    def admit(self, n: int, step: int | None = None) -> None:
        self._open(step, n)
        with self._together():
            self.admitted += n
            if self.metrics is not None:
                self.metrics.samples_admitted.inc(n)

    def train(self, n: int, step: int | None = None) -> None:
        self._open(step, -n)
        with self._together():
            self.trained += n
            if self.metrics is not None:
                self.metrics.samples_trained.inc(n)

    def filter(self, reason: str, n: int = 1, step: int | None = None) -> None:
        self._open(step, -n)
        with self._together():
            self.filtered[reason] += n
            if self.metrics is not None:
                self.metrics.samples_filtered.labels(reason=reason).inc(n)

    def fail(self, reason: str, n: int = 1, step: int | None = None) -> None:
        self._open(step, -n)
        if step is not None:
            counts, first = self.step_failures.setdefault(step, (Counter(), {}))
            counts[_short(reason)] += n
            first.setdefault(_short(reason), reason)
        with self._together():
            self.failed[_short(reason)] += n
            if self.metrics is not None:
                self.metrics.samples_failed.labels(reason=_short(reason)).inc(n)

    def hand_off(self, n: int, step: int | None = None) -> None:
        """An engine process settles a sample by sending it to its learner rank, which counts it again."""
        self._open(step, -n)
        self.handed_off += n

    @property
    def settled(self) -> int:
        return self.trained + self.handed_off + sum(self.filtered.values()) + sum(self.failed.values())

    @property
    def in_flight(self) -> int:
        return sum(self.open_by_step.values())

    def check(self, step: int) -> None:
        """Called at the end of every train step: every sample of steps up to ``step`` is settled, and
        admitted = settled + in flight (samples of later steps, admitted early under max_staleness > 0)."""
        unsettled = {s: n for s, n in self.open_by_step.items() if s <= step}
        if self.admitted != self.settled + self.in_flight or unsettled:
            raise AccountingError(
                f"rank {self.rank} step {step}: admitted={self.admitted} but trained={self.trained} + "
                f"filtered={dict(self.filtered)} + failed={dict(self.failed)} = {self.settled}, in flight "
                f"{dict(self.open_by_step)}; a sample was lost or counted twice"
            )



    def take_step_failures(self, step: int) -> tuple[Counter, dict[str, str]]:
        """Failed samples of ``step`` by kind and the first reason of each kind; forgotten here (earlier
        steps too, so this stays bounded)."""
        out = self.step_failures.pop(step, (Counter(), {}))
        for old in [s for s in self.step_failures if s < step]:
            del self.step_failures[old]
        return out

    def check_step(self, step: int) -> None:
        """Every sample of ``step`` is settled (an engine process at the step's end_of_step)."""
        if self.open_by_step.get(step, 0):
            raise AccountingError(f"rank {self.rank} step {step}: {self.open_by_step[step]} samples of the step "
                                  "are neither handed off, filtered nor failed at its end; a sample was lost")

    def state_dict(self) -> dict:
        """The counters, JSON-encodable (checkpoints), as if the samples in flight had never been
        admitted: a resumed run drops them and generates them again (their seeds are a function of
        (seed, step, prompt, sample)), so none is trained twice. Samples of later steps that were already
        filtered or failed stay counted as settled and admitted."""
        return {"admitted": self.admitted - self.in_flight, "trained": self.trained, "filtered": dict(self.filtered),
                "failed": dict(self.failed), "refilled_prompts": self.refilled_prompts}

    def load_state_dict(self, state: dict) -> None:
        self.admitted, self.trained = state["admitted"], state["trained"]
        self.filtered, self.failed = Counter(state["filtered"]), Counter(state["failed"])
        self.refilled_prompts = state["refilled_prompts"]
        self.open_by_step.clear()

    def summary(self) -> dict[str, float]:
        out = {"samples_admitted": self.admitted, "samples_trained": self.trained}
        out.update({f"samples_filtered/{k}": v for k, v in self.filtered.items()})
        out.update({f"samples_failed/{k}": v for k, v in self.failed.items()})
        out["refilled_prompts"] = self.refilled_prompts
        return out


def _short(reason: str) -> str:
    """Metric label of a failure: its kind before the first colon (keeps label cardinality bounded)."""
    return reason.split(":", 1)[0].strip()[:64] or "unknown"
