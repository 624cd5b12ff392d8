"""``streamrft trajectories analyze PATH``: what the policy is writing, from the trajectory sinks.

Measures, over all records (any status):

- repetition: fraction of responses in which some ``ngram``-gram of token ids occurs at least twice,
  and the mean distinct-1 / distinct-2 (distinct n-grams / all n-grams, per response) — degenerate
  looping drives the first up and the second down;
- reflection: how many responses use words like "wait", "recheck", "however", "let me verify"
  (case-insensitive, whole words), per pattern and in total;
- entropy: mean, p50, p90, p99 of per-token entropy (nats) pooled over all response tokens, and the
  fraction of tokens above ``high_entropy`` nats (the "forking" tokens);
- reward: mean, std, min, max, per-component means; advantage mean; statuses, finish reasons.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from protocols import TrajectoryRecord
from streamrft.sinks.reader import read_trajectories

REFLECTION_PATTERNS = ("wait", "recheck", "re-check", "however", "let me verify", "let me check", "double-check")
DEFAULT_NGRAM = 4
DEFAULT_HIGH_ENTROPY = 2.0  # nats; a near-uniform choice among ~7 tokens


def _has_repeated_ngram(ids: Sequence[int], n: int) -> bool:
    seen: set[tuple[int, ...]] = set()
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i : i + n])
        if gram in seen:
            return True
        seen.add(gram)
    return False


def _distinct_n(ids: Sequence[int], n: int) -> float | None:
    total = len(ids) - n + 1
    if total <= 0:
        return None
    return len({tuple(ids[i : i + n]) for i in range(total)}) / total


def _summary(values: Iterable[float]) -> dict[str, float]:
    array = np.asarray(list(values), dtype=np.float64)
    if array.size == 0:
        return {"count": 0}
    return {
        "count": int(array.size),
        "mean": float(array.mean()),
        "std": float(array.std()),
        "min": float(array.min()),
        "max": float(array.max()),
    }


def analyze_records(
    records: Iterable[TrajectoryRecord], ngram: int = DEFAULT_NGRAM, high_entropy: float = DEFAULT_HIGH_ENTROPY
) -> dict[str, Any]:
    """The report (a JSON-ready dict) for ``records``; see the module docstring for the measures."""
    reflection_regexes = {p: re.compile(rf"\b{re.escape(p)}\b", re.IGNORECASE) for p in REFLECTION_PATTERNS}
    n = 0
    repeated = 0
    distinct = {1: [], 2: []}
    reflection_counts: Counter[str] = Counter()
    responses_reflecting = 0
    entropies: list[np.ndarray] = []
    rewards: list[float] = []
    advantages: list[float] = []
    components: dict[str, list[float]] = {}
    lengths: list[int] = []
    statuses: Counter[str] = Counter()
    finish_reasons: Counter[str] = Counter()
    steps: set[int] = set()
    for record in records:
        n += 1
        steps.add(record.step)
        ids = record.response_ids
        lengths.append(len(ids))
        repeated += _has_repeated_ngram(ids, ngram)
        for k in distinct:
            value = _distinct_n(ids, k)
            if value is not None:
                distinct[k].append(value)
        hits = {p: len(rx.findall(record.response)) for p, rx in reflection_regexes.items()}
        reflection_counts.update({p: c for p, c in hits.items() if c})
        responses_reflecting += any(hits.values())
        if record.entropy:
            entropies.append(np.asarray(record.entropy, dtype=np.float64))
        rewards.append(record.reward)
        advantages.append(record.advantage)
        for name, value in record.reward_components.items():
            components.setdefault(name, []).append(value)
        statuses[record.status] += 1
        finish_reasons[record.finish_reason or "unknown"] += 1

    pooled = np.concatenate(entropies) if entropies else np.zeros(0)
    entropy: dict[str, Any] = {"tokens": int(pooled.size), "high_entropy_threshold": high_entropy}
    if pooled.size:
        p50, p90, p99 = np.percentile(pooled, [50, 90, 99])
        entropy.update(
            mean=float(pooled.mean()), p50=float(p50), p90=float(p90), p99=float(p99),
            high_entropy_fraction=float((pooled > high_entropy).mean()),
        )
    return {
        "samples": n,
        "steps": len(steps),
        "status": dict(statuses),
        "finish_reason": dict(finish_reasons),
        "response_length": _summary(lengths),
        "repetition": {
            "ngram": ngram,
            "repeated_ngram_fraction": repeated / n if n else 0.0,
            "distinct_1_mean": float(np.mean(distinct[1])) if distinct[1] else None,
            "distinct_2_mean": float(np.mean(distinct[2])) if distinct[2] else None,
        },
        "reflection": {
            "counts": {p: reflection_counts.get(p, 0) for p in REFLECTION_PATTERNS},
            "responses_with_any_fraction": responses_reflecting / n if n else 0.0,
        },
        "entropy": entropy,
        "reward": _summary(rewards),
        "reward_components": {name: float(np.mean(v)) for name, v in sorted(components.items())},
        "advantage_mean": float(np.mean(advantages)) if advantages else None,
    }


def analyze_trajectories(
    path: str | os.PathLike, ngram: int = DEFAULT_NGRAM, high_entropy: float = DEFAULT_HIGH_ENTROPY
) -> dict[str, Any]:
    """Analyse a JSONL file, a Parquet file, or a directory of either (as the sinks write them)."""
    report = analyze_records(read_trajectories(path), ngram=ngram, high_entropy=high_entropy)
    report["path"] = str(path)
    return report


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_report(report: dict[str, Any]) -> str:
    """The human-readable report printed by ``streamrft trajectories analyze``."""
    rep, ent, rew = report["repetition"], report["entropy"], report["reward"]
    lines = [
        f"trajectories: {report['path']}",
        f"  samples {report['samples']} over {report['steps']} steps; status {report['status']}; "
        f"finish {report['finish_reason']}",
        f"  response length: mean {_fmt(report['response_length'].get('mean'))}, "
        f"max {_fmt(report['response_length'].get('max'))}",
        "repetition:",
        f"  responses with a repeated {rep['ngram']}-gram: {rep['repeated_ngram_fraction']:.1%}",
        f"  distinct-1 {_fmt(rep['distinct_1_mean'])}, distinct-2 {_fmt(rep['distinct_2_mean'])}",
        "reflection:",
        f"  responses with any pattern: {report['reflection']['responses_with_any_fraction']:.1%}",
        "  " + ", ".join(f"{p!r}: {c}" for p, c in report["reflection"]["counts"].items()),
        f"entropy (nats, {ent['tokens']} tokens):",
    ]
    if ent["tokens"]:
        lines.append(
            f"  mean {_fmt(ent['mean'])}, p50 {_fmt(ent['p50'])}, p90 {_fmt(ent['p90'])}, p99 {_fmt(ent['p99'])}; "
            f"above {ent['high_entropy_threshold']:g}: {ent['high_entropy_fraction']:.1%}"
        )
    else:
        lines.append("  no per-token entropy in these records")
    lines += [
        "reward:",
        f"  mean {_fmt(rew.get('mean'))}, std {_fmt(rew.get('std'))}, "
        f"min {_fmt(rew.get('min'))}, max {_fmt(rew.get('max'))}; advantage mean {_fmt(report['advantage_mean'])}",
    ]
    for name, mean in report["reward_components"].items():
        lines.append(f"  {name}: mean {_fmt(mean)}")
    return "\n".join(lines)


def analyze_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="streamrft trajectories analyze", description="Repetition, reflection, entropy and reward statistics."
    )
    parser.add_argument("path", help="a .jsonl / .parquet file or a directory written by the trajectory sinks")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--ngram", type=int, default=DEFAULT_NGRAM, help="n of the repeated n-gram test")
    parser.add_argument("--high-entropy", type=float, default=DEFAULT_HIGH_ENTROPY, help="threshold in nats")
    args = parser.parse_args(argv)
    try:
        report = analyze_trajectories(args.path, ngram=args.ngram, high_entropy=args.high_entropy)
    except (FileNotFoundError, ValueError) as exc:
        print(f"streamrft trajectories analyze: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(analyze_main())
