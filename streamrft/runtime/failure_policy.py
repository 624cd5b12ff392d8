"""The failure policy: a run whose samples fail stops loudly instead of training on nothing.

After each train step (``reward.max_failed_fraction`` = f, default 0.5):

* a reward source that failed more than f of the samples it scored in the step, summed over ranks
  (raised, timed out, NaN/inf, not a number, service down or answering an error), stops the run;
* a step that trained no sample on any rank stops the run;
* f = 1.0 never stops (failures are still counted and printed).

Every rank decides from the same all-reduced counts, so all ranks stop at the same step (one rank
stopping alone would leave the others waiting in a collective). The error names the source, the
counts, the step and the first failure this rank saw, with its sample id. Rank 0 prints the step's
failed samples by kind every step that has any.

Pure logic: counts in, a console line and an error message out; the reduction is passed in
(``reduce(list[float]) -> list[float]``, a sum over ranks), so this module imports no torch.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

# Failure kinds (the part of a reason before its first colon) reduced by position; others add to "other".
KINDS = ("reward", "teacher", "media_error", "data_error", "env_error")


class FailurePolicyError(RuntimeError):
    """The run stopped because too many samples failed (reward.max_failed_fraction)."""


def exceeds(failed: float, scored: float, limit: float) -> bool:
    """Whether ``failed`` of ``scored`` passes the limit (strictly more than ``limit``; 1.0 never does)."""
    return scored > 0 and failed / scored > limit


def failure_line(step: int, by_kind: Mapping[str, float], first: str) -> str:
    """``step 3: failed 12 (reward: 10, teacher: 2) — first: reward: source 'f': ...``; "" when none failed."""
    total = int(sum(by_kind.values()))
    if not total:
        return ""
    kinds = ", ".join(f"{k}: {int(n)}" for k, n in by_kind.items() if n)
    return f"step {step}: failed {total} ({kinds})" + (f" — first: {first}" if first else "")


def check_step(
    step: int,
    limit: float,
    trained: int,
    failed_by_kind: Mapping[str, int],
    first_by_kind: Mapping[str, str],
    sources: Mapping[str, object],
    reduce: Callable[[Sequence[float]], Sequence[float]],
) -> tuple[str, str | None]:
    """Decide for one step: returns (console line, or ""; error message, or None to go on).

    ``step`` as the console shows it (1-based); ``trained`` this rank's trained samples;
    ``failed_by_kind`` / ``first_by_kind`` this rank's failed samples of the step by kind and the first
    reason of each (Accounting.take_step_failures); ``sources`` this rank's per-source tallies with
    ``scored``, ``failed``, ``first_failure`` (RewardScorer.take_step), the same names in the same
    order on every rank (they come from the config). Collective: every rank must call it.
    """
    names = list(sources)
    local = [float(trained)] + [float(failed_by_kind.get(k, 0)) for k in KINDS]
    local.append(float(sum(n for k, n in failed_by_kind.items() if k not in KINDS)))
    for name in names:
        local += [float(sources[name].scored), float(sources[name].failed)]
    total = list(reduce(local))
    trained_all = total[0]
    by_kind = dict(zip((*KINDS, "other"), total[1 : len(KINDS) + 2]))
    first = next(iter(first_by_kind.values()), "")
    line = failure_line(step, by_kind, first)
    if limit >= 1.0:
        return line, None
    for i, name in enumerate(names):
        scored, failed = total[len(KINDS) + 2 + 2 * i : len(KINDS) + 4 + 2 * i]
        if exceeds(failed, scored, limit):
            seen = sources[name].first_failure or "(on another rank)"
            return line, (
                f"reward source {name!r} failed {int(failed)} of {int(scored)} samples at step {step} "
                f"(limit {limit:g}, reward.max_failed_fraction): first failure: {seen}"
            )
    if trained_all == 0:
        failed_all = int(sum(by_kind.values()))
        if failed_all:
            kinds = ", ".join(f"{k}: {int(n)}" for k, n in by_kind.items() if n)
            why = f"failed {failed_all} ({kinds}); first failure: {first or '(on another rank)'}"
        else:
            why = "every sample was filtered (samples_filtered/* in the metrics and summary say why)"
        return line, (
            f"step {step} trained no sample on any rank: {why}; stopping (reward.max_failed_fraction={limit:g}, "
            "1.0 = never stop)"
        )
    return line, None
