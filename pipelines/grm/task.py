"""Judgment rows for a generative judge on arithmetic: which of two answers is the correct sum.

``{"prompt": "12+7=", "responses": ["18", "19"], "judgment": "[[B]]"}``: the correct answer and a near
miss (pipelines.srm.task.wrong_answer) in random order; the verdict names the correct one.
"""

from __future__ import annotations

import random

from pipelines.arith.task import ARITH_ALPHABET, all_problems
from pipelines.srm.task import wrong_answer

# The arith characters plus what the judge template and verdicts use ("Q:{prompt} A:{a} B:{b} V:", "[[A]]").
GRM_ALPHABET = ARITH_ALPHABET + "QABV:[]"


def make_judgments(split: str, n: int, seed: int, **task) -> list[dict]:
    rng = random.Random(seed)
    problems = all_problems(split, **task)
    rng.shuffle(problems)
    rows = []
    for prompt, answer in problems[:n]:
        wrong = wrong_answer(answer, rng)
        if rng.random() < 0.5:
            rows.append({"prompt": prompt, "responses": [answer, wrong], "judgment": "[[A]]"})
        else:
            rows.append({"prompt": prompt, "responses": [wrong, answer], "judgment": "[[B]]"})
    return rows
