"""The reward aggregator: every configured source scores the items it applies to; one outcome per item.

For an item with label L, the sources that apply are those whose ``labels`` include L (or are empty).
Each gives a component under its own name; the aggregate is

    reward = sum over applying sources s of weight_s(L) * component_s

where ``weight_s(L)`` is ``label_weights[L]`` when set, else ``weight``. Sources run concurrently.
An item fails (reward NaN, ``error`` naming the source and the cause) when any applying source raises,
times out or gives NaN/inf for it, or when no source applies to its label (or every one that does
answered ``NOT_APPLICABLE`` for it: a TRL function's None, see streamrft/rewards/conventions.py). ``score()`` never raises
for a source's failure and never waits longer than the slowest source's deadline.

Calls made for a train step (``score(items, step=k)``) are also tallied per step and source (items
asked, items failed, the first failure with its sample id): the failure policy
(streamrft/runtime/failure_policy.py) reads them with :meth:`RewardScorer.take_step`.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Sequence

from protocols import RewardItem
from streamrft.config.base import ConfigError
from streamrft.config.reward import RewardConfig
from streamrft.rewards.conventions import NOT_APPLICABLE
from streamrft.rewards.sources import RewardSource, build_source


@dataclass
class RewardOutcome:
    reward: float  # the weighted aggregate; NaN when error is set
    components: dict[str, float]  # source name -> its value for this item (the sources that succeeded)
    error: str = ""  # "" = scored; otherwise which source failed and why


class RewardTimeout(TimeoutError):
    """A source gave no value within its deadline (a sync function may still run in its thread)."""


@dataclass
class SourceTally:
    """One source's items within one train step."""

    scored: int = 0  # items the source was asked to score
    failed: int = 0  # of which it failed (raised, timed out, non-finite, not a number)
    first_failure: str = ""  # e.g. "ValueError('boom') in sample s2-p5-3"


@dataclass
class RewardScorer:
    """Scores microbatches of RewardItems with every configured source. Counters are cumulative."""

    sources: list[RewardSource]
    n_scored: int = 0  # items with a finite reward
    n_failed: int = 0  # items with an error outcome
    failures_by_source: dict[str, int] = field(default_factory=dict)  # items each source failed
    by_step: dict[int, dict[str, SourceTally]] = field(default_factory=dict)  # until take_step(step)

    def take_step(self, step: int) -> dict[str, SourceTally]:
        """Every configured source's tally for train step ``step`` (zeros for a source that scored
        nothing), forgotten here; tallies of earlier steps are dropped too (bounded memory)."""
        tally = self.by_step.pop(step, {})
        for old in [s for s in self.by_step if s < step]:
            del self.by_step[old]
        return {src.name: tally.get(src.name, SourceTally()) for src in self.sources}

    async def score(self, items: Sequence[RewardItem], step: int | None = None) -> list[RewardOutcome]:
        """``step``: the train step these items belong to, tallied for the failure policy (None for
        held-out evaluation and other callers)."""
        items = list(items)
        picks = [[i for i, it in enumerate(items) if src.applies_to(it.label)] for src in self.sources]
        runs = [self._run_source(src, [items[i] for i in idx]) for src, idx in zip(self.sources, picks)]
        # one source (the common case): await it directly, no task per call
        results = [await runs[0]] if len(runs) == 1 else await asyncio.gather(*runs)
        components: list[dict[str, float]] = [{} for _ in items]
        totals = [0.0] * len(items)
        errors: list[list[str]] = [[] for _ in items]
        applied = [False] * len(items)
        declined: list[list[str]] = [[] for _ in items]
        for src, idx, values in zip(self.sources, picks, results):
            tally = self.by_step.setdefault(step, {}).setdefault(src.name, SourceTally()) if step is not None else None
            if tally is not None:
                tally.scored += len(idx)
            for i, value in zip(idx, values):
                if value is NOT_APPLICABLE:  # the function said it does not score this item (TRL's None)
                    declined[i].append(src.name)
                    continue
                applied[i] = True
                problem = _problem(value)
                if problem:
                    errors[i].append(f"source {src.name!r}: {problem}")
                    self.failures_by_source[src.name] = self.failures_by_source.get(src.name, 0) + 1
                    if tally is not None:
                        tally.failed += 1
                        if not tally.first_failure:
                            tally.first_failure = f"{_describe(value)} in sample {items[i].sample_id}"
                    continue
                components[i][src.name] = float(value)
                for key, extra in getattr(value, "extras", {}).items():  # verl's other dict keys: logged, not summed
                    components[i][f"{src.name}/{key}"] = extra
                totals[i] += src.weight_for(items[i].label) * float(value)
        outcomes = []
        for i, item in enumerate(items):
            if not applied[i] and declined[i]:
                errors[i].append(f"every reward source for label {item.label!r} returned None (not applicable): "
                                 f"{', '.join(declined[i])}")
            elif not applied[i]:
                errors[i].append(
                    f"no reward source scores label {item.label!r}; add it to a source's reward.sources[*].labels "
                    "or leave that source's labels empty"
                )
            if errors[i]:
                self.n_failed += 1
                outcomes.append(RewardOutcome(math.nan, components[i], "; ".join(errors[i])))
            else:
                self.n_scored += 1
                outcomes.append(RewardOutcome(totals[i], components[i]))
        return outcomes

    async def _run_source(self, src: RewardSource, items: list[RewardItem]) -> list[float | Exception]:
        if not items:
            return []
        try:
            async with asyncio.timeout(src.deadline_s):  # unlike wait_for (3.11), no extra task
                values = await src.backend.score(items)
        except TimeoutError:
            # A sync function keeps running in its source's own daemon thread (threads cannot be
            # killed); its result is dropped. The items fail now instead of stalling the pipeline.
            return [RewardTimeout(f"timeout after {src.deadline_s:g}s (reward.timeout_s)")] * len(items)
        except Exception as exc:  # a backend bug: fail these items with the cause, keep the run going
            return [exc] * len(items)
        if len(values) != len(items):
            err = ValueError(f"returned {len(values)} values for {len(items)} items")
            return [err] * len(items)
        return values

    async def close(self) -> None:
        for src in self.sources:
            await src.backend.close()


def _problem(value: float | Exception) -> str:
    """Why a source's value for one item is unusable ("" when it is fine)."""
    if isinstance(value, RewardTimeout):
        return str(value)
    if isinstance(value, Exception):
        return f"{type(value).__name__}: {value}"
    if not math.isfinite(value):
        return f"returned {value} (rewards must be finite)"
    return ""


def _describe(value: float | Exception) -> str:
    """A failure as the failure policy quotes it: ``ValueError('boom')``, ``timeout after 2s ...``."""
    if isinstance(value, RewardTimeout) or not isinstance(value, Exception):
        return _problem(value)
    return f"{type(value).__name__}({str(value)[:300]!r})"


def build_reward_scorer(cfg: RewardConfig) -> RewardScorer:
    """Build every source of ``reward.sources``. An empty list is a ConfigError: there is no implicit
    default reward (a run that trains on a reward nobody chose would learn nothing meaningful)."""
    if not cfg.sources:
        raise ConfigError(
            "reward.sources is empty; add a source, e.g. reward.sources: [{name: correct, type: rule, fn: gsm8k}]"
        )
    return RewardScorer([build_source(src, cfg) for src in cfg.sources])
