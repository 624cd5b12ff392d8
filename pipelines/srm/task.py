"""Synthetic preference pairs on arithmetic where the right preference is known: the correct sum is
chosen, a nearby wrong answer rejected, e.g. ``{"prompt": "12+7=", "chosen": "19", "rejected": "18"}``.

Wrong answers are the near misses a policy makes: the correct value plus an offset drawn from
``OFFSETS`` (off by one, two, ten, ...) or with one digit replaced, never negative, never correct.
Pairs follow the arith task's train/eval split (``pipelines.arith.task.split_of``), so held-out
pairs are about held-out problems.
"""

from __future__ import annotations

import random

from pipelines.arith.task import all_problems

OFFSETS = (-20, -11, -10, -9, -2, -1, 1, 2, 9, 10, 11, 20)
# Carry slips: a carry dropped or added into the tens / hundreds (+-10, +-100), a units digit off by one.
HARD_OFFSETS = (-110, -100, -11, -10, -9, -1, 1, 9, 10, 11, 100)


def wrong_answer(answer: str, rng: random.Random, hard_fraction: float = 0.0) -> str:
    """A plausible wrong answer to ``answer`` (a non-negative integer string): with probability
    ``hard_fraction`` a carry slip (``HARD_OFFSETS``), else a near miss (``OFFSETS``) or one digit replaced."""
    value = int(answer)
    while True:
        if hard_fraction > 0 and rng.random() < hard_fraction:
            candidate = value + rng.choice(HARD_OFFSETS)
        elif rng.random() < 0.5:
            candidate = value + rng.choice(OFFSETS)
        else:
            digits = list(answer)
            i = rng.randrange(len(digits))
            digits[i] = str(rng.randrange(10))
            candidate = int("".join(digits))
        if candidate >= 0 and candidate != value:
            return str(candidate)


def make_pairs(split: str, n: int, seed: int, pairs_per_problem: int = 1, hard_fraction: float = 0.0,
               **task) -> list[dict]:
    """``n`` preference rows from the ``split`` problems of the arith task (``task``: its operand range);
    ``hard_fraction`` of the rejected answers are carry slips (:func:`wrong_answer`)."""
    rng = random.Random(seed)
    problems = all_problems(split, **task)
    rng.shuffle(problems)
    rows = []
    for prompt, answer in problems:
        for _ in range(pairs_per_problem):
            rows.append({"prompt": prompt, "chosen": answer, "rejected": wrong_answer(answer, rng, hard_fraction)})
            if len(rows) == n:
                return rows
    return rows
