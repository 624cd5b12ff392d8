"""Judgment rows for a generative judge on arithmetic: which of two answers is the correct sum.

``{"prompt": "12+7=", "responses": ["18", "19"], "judgment": "19[[B]]"}``: the correct answer and a near
miss (pipelines.srm.task.wrong_answer) in random order; the judgment first works the sum out, then
names the response that matches it (a rationale before the verdict, as in generative verifiers with
chain of thought, Zhang et al. 2024). The template ``A:{a} B:{b} Q:{prompt}`` ends with the problem
itself, so the judge writes the sum exactly where its arithmetic warm-up taught it to.
"""

from __future__ import annotations

import random

from pipelines.arith.task import ARITH_ALPHABET, all_problems
from pipelines.srm.task import wrong_answer

# The arith characters plus what the judge template and verdicts use ("A:{a} B:{b} Q:{prompt}", "[[A]]").
GRM_ALPHABET = ARITH_ALPHABET + "QABV:[]"


def make_judgments(split: str, n: int, seed: int, **task) -> list[dict]:
    rng = random.Random(seed)
    problems = all_problems(split, **task)
    rng.shuffle(problems)
    rows = []
    for prompt, answer in problems[:n]:
        wrong = wrong_answer(answer, rng)
        if rng.random() < 0.5:
            rows.append({"prompt": prompt, "responses": [answer, wrong], "judgment": f"{answer}[[A]]"})
        else:
            rows.append({"prompt": prompt, "responses": [wrong, answer], "judgment": f"{answer}[[B]]"})
    return rows
