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
    metrics: object | None = None  # PipelineMetrics, when exported

    def _together(self):
        """Each count and its exported counter change under the scrape lock, so a scrape (whose probe
        derives in_flight{stage="pipeline"} from these counts) never sees one without the other."""
        return self.metrics.atomic() if self.metrics is not None else contextlib.nullcontext()

    def admit(self, n: int) -> None:
        with self._together():
            self.admitted += n
            if self.metrics is not None:
                self.metrics.samples_admitted.inc(n)

    def train(self, n: int) -> None:
        with self._together():
            self.trained += n
            if self.metrics is not None:
                self.metrics.samples_trained.inc(n)

    def filter(self, reason: str, n: int = 1) -> None:
        with self._together():
            self.filtered[reason] += n
            if self.metrics is not None:
                self.metrics.samples_filtered.labels(reason=reason).inc(n)

    def fail(self, reason: str, n: int = 1) -> None:
        with self._together():
            self.failed[_short(reason)] += n
            if self.metrics is not None:
                self.metrics.samples_failed.labels(reason=_short(reason)).inc(n)

    @property
    def settled(self) -> int:
        return self.trained + sum(self.filtered.values()) + sum(self.failed.values())

    def check(self, step: int) -> None:
        """Called at the end of every step, when nothing is in flight."""
        if self.admitted != self.settled:
            raise AccountingError(
                f"rank {self.rank} step {step}: admitted={self.admitted} but trained={self.trained} + "
                f"filtered={dict(self.filtered)} + failed={dict(self.failed)} = {self.settled}; "
                "a sample was lost or counted twice"
            )

    def state_dict(self) -> dict:
        """The counters, JSON-encodable (checkpoints)."""
        return {"admitted": self.admitted, "trained": self.trained, "filtered": dict(self.filtered),
                "failed": dict(self.failed), "refilled_prompts": self.refilled_prompts}

    def load_state_dict(self, state: dict) -> None:
        self.admitted, self.trained = state["admitted"], state["trained"]
        self.filtered, self.failed = Counter(state["filtered"]), Counter(state["failed"])
        self.refilled_prompts = state["refilled_prompts"]

    def summary(self) -> dict[str, float]:
        out = {"samples_admitted": self.admitted, "samples_trained": self.trained}
        out.update({f"samples_filtered/{k}": v for k, v in self.filtered.items()})
        out.update({f"samples_failed/{k}": v for k, v in self.failed.items()})
        out["refilled_prompts"] = self.refilled_prompts
        return out


def _short(reason: str) -> str:
    """Metric label of a failure: its kind before the first colon (keeps label cardinality bounded)."""
    return reason.split(":", 1)[0].strip()[:64] or "unknown"
