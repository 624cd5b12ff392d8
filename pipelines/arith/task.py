"""The synthetic arithmetic task of the CPU demo: "a+b=" -> "c", checked by exact match.

Problems are pairs of integers in ``[min_operand, max_operand]`` joined by an operator from ``ops``.
Every problem belongs to exactly one split, decided by a stable hash of its prompt
(``eval`` if ``blake2b(prompt) mod 1000 < 1000 * eval_fraction``), so the train and held-out eval sets
are disjoint by construction whatever ``n`` and ``seed`` are.

Rows are jsonl: ``{"prompt": "23+45=", "reference": "68", "label": "arith"}``.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from typing import Sequence

from pipelines.common import write_jsonl

ARITH_ALPHABET = "0123456789+-*= "
LABEL = "arith"
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _check_ops(ops: str) -> None:
    bad = [op for op in ops if op not in _OPS]
    if not ops or bad:
        raise ValueError(f"ops={ops!r} must be a non-empty string of operators from {''.join(_OPS)!r}")


def format_problem(a: int, op: str, b: int) -> tuple[str, str]:
    """(prompt, answer) for ``a op b``, e.g. (23, '+', 45) -> ("23+45=", "68")."""
    return f"{a}{op}{b}=", str(_OPS[op](a, b))


def make_problem(rng: random.Random, min_operand: int = 0, max_operand: int = 99, ops: str = "+") -> tuple[str, str]:
    """One random problem: operands uniform in ``[min_operand, max_operand]``, operator uniform in ``ops``."""
    _check_ops(ops)
    a = rng.randint(min_operand, max_operand)
    b = rng.randint(min_operand, max_operand)
    return format_problem(a, rng.choice(ops), b)


def split_of(prompt: str, eval_fraction: float) -> str:
    """``"eval"`` or ``"train"``: a stable function of the prompt text alone."""
    bucket = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "little") % 1000
    return "eval" if bucket < round(1000 * eval_fraction) else "train"


def all_problems(split: str, min_operand: int = 0, max_operand: int = 99, ops: str = "+",
                 eval_fraction: float = 0.1) -> list[tuple[str, str]]:
    """Every problem of one split, in a fixed order."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} must be 'train' or 'eval'")
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction={eval_fraction} must be in (0, 1)")
    if min_operand < 0 or max_operand < min_operand:
        raise ValueError(f"operand range [{min_operand}, {max_operand}] must satisfy 0 <= min_operand <= max_operand")
    _check_ops(ops)
    problems = []
    for op in ops:
        for a in range(min_operand, max_operand + 1):
            for b in range(min_operand, max_operand + 1):
                prompt, answer = format_problem(a, op, b)
                if split_of(prompt, eval_fraction) == split:
                    problems.append((prompt, answer))
    return problems


def make_rows(n: int, seed: int, split: str = "train", min_operand: int = 0, max_operand: int = 99,
              ops: str = "+", eval_fraction: float = 0.1) -> list[dict]:
    """``n`` distinct problems of ``split``, chosen by a shuffle seeded with ``seed``."""
    problems = all_problems(split, min_operand, max_operand, ops, eval_fraction)
    if n > len(problems):
        raise ValueError(f"n={n} exceeds the {len(problems)} distinct {split} problems for operands "
                         f"[{min_operand}, {max_operand}] and ops={ops!r}; lower n or widen the operand range")
    random.Random(seed).shuffle(problems)
    return [{"prompt": p, "reference": r, "label": LABEL} for p, r in problems[:n]]


def write_dataset(path: str, n: int, seed: int, split: str = "train", min_operand: int = 0,
                  max_operand: int = 99, ops: str = "+", eval_fraction: float = 0.1) -> str:
    """Write ``make_rows(...)`` as jsonl to ``path``; returns ``path``. Deterministic given the arguments."""
    return write_jsonl(path, make_rows(n, seed, split, min_operand, max_operand, ops, eval_fraction))


def is_correct(response: str, reference: str) -> bool:
    """Exact match of the answer: the response text (EOS already stripped) equals the reference."""
    return response.strip() == reference.strip()


def greedy_accuracy(model, tokenizer, rows: Sequence[dict], max_new_tokens: int = 8, batch_size: int = 256) -> float:
    """Fraction of ``rows`` whose greedy (top_k=1) answer matches ``reference`` exactly."""
    from streamrft.config.engine import EngineConfig
    from streamrft.engines.base import GenerationRequest
    from streamrft.engines.hf import HFEngine

    if not rows:
        raise ValueError("greedy_accuracy got no rows; pass at least one {'prompt', 'reference'} row")
    cfg = EngineConfig(top_k=1, max_new_tokens=max_new_tokens, max_batch_size=batch_size)
    device = next(model.parameters()).device
    engine = HFEngine(model, cfg, [tokenizer.eos_token_id], tokenizer.pad_token_id, device)
    requests = [GenerationRequest(str(i), tokenizer(r["prompt"])["input_ids"], seed=i) for i, r in enumerate(rows)]
    samples = asyncio.run(engine.generate_all(requests))
    correct = sum(
        is_correct(tokenizer.decode(s.response_ids, skip_special_tokens=True), r["reference"])
        for s, r in zip(samples, rows)
    )
    return correct / len(rows)
