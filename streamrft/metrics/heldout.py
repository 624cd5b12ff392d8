"""Held-out evaluation results as per-step scalars, under one name in steps.jsonl, Prometheus,
TensorBoard and W&B: ``heldout/accuracy``, ``heldout/reward_mean``, ``heldout/n`` (and
``heldout/media_errors`` for media rows).

Steps are 1-based everywhere: step N is the policy after N train steps, so the evaluation before
training is step 0, a periodic one (``train.eval_every``) step N and the final one ``train.max_steps``.
In steps.jsonl (one line per train step, which scripts index by position) an evaluation at step N >= 1
is merged into step N's line; the evaluation before training goes into the first step's line as
``heldout/accuracy_before`` etc. (there is no step 0 line). TensorBoard and W&B log it at step 0.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path


def heldout_scalars(result: Mapping[str, object]) -> dict[str, float]:
    """``{"heldout_accuracy": a, "heldout_n": n, ...}`` (runtime.evaluation.evaluate) ->
    ``{"heldout/accuracy": a, "heldout/n": n, ...}``; non-numbers are left out."""
    return {
        f"heldout/{key[len('heldout_'):]}": float(value)
        for key, value in result.items()
        if key.startswith("heldout_") and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def before_fields(scalars: Mapping[str, float]) -> dict[str, float]:
    """The names the evaluation before training has in the first step's steps.jsonl line."""
    return {f"{name}_before": value for name, value in scalars.items()}


def merge_into_step_line(path: str | Path, step: int, fields: Mapping[str, float]) -> bool:
    """Add ``fields`` to the last line of steps.jsonl if that line is step ``step``; True if it was.

    The file is rewritten through a temporary file and ``os.replace``, so a crash leaves either the old
    or the new file, never a torn line.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return False
    lines = text.splitlines()
    if not lines:
        return False
    try:
        last = json.loads(lines[-1])
    except json.JSONDecodeError:
        return False  # a torn line is the resume code's to report, not this one's to touch
    if not isinstance(last, dict) or last.get("step") != step:
        return False
    last.update(fields)
    lines[-1] = json.dumps(last)
    tmp = path.with_name(path.name + ".heldout.tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)
    return True
