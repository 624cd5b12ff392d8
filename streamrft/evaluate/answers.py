"""Answer extraction and checking per benchmark format, picked by name from :data:`FORMATS`.

Each format gives ``extract(text) -> str | None`` (a canonical answer used for voting) and
``check(answer, reference) -> bool``:

- ``arith``: the first integer of the response (a leading '-' allowed); equal as integers.
- ``gsm8k``: the number after the last ``####``, else the last ``\\boxed{}``, else the last number
  (streamrft.rewards.rules.extract_gsm8k_answer); reference as a bare number or ``... #### n``.
- ``math``: the last ``\\boxed{...}`` (spaces removed); equivalence by math-verify (the ``math`` rule).
- ``choice``: a multiple-choice letter A-J: "answer is (B)" / "Answer: B", else a lone letter
  (optionally in parentheses) at the start or end; equal case-insensitively.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from streamrft.rewards.rules import _numbers_equal, extract_gsm8k_answer, find_boxed, math_rule

_INT_RE = re.compile(r"-?\d+")
_CHOICE_RES = (
    re.compile(r"answer\s*(?:is|:)?\s*\(?([A-J])\)?(?![A-Za-z])", re.IGNORECASE),
    re.compile(r"^\s*\(?([A-J])\)?(?![A-Za-z])"),
    re.compile(r"(?<![A-Za-z])\(?([A-J])\)?\s*\.?\s*$"),
)


@dataclass(frozen=True)
class AnswerFormat:
    extract: Callable[[str], str | None]
    check: Callable[[str, str], bool]


def _arith_extract(text: str) -> str | None:
    m = _INT_RE.search(text)
    return str(int(m.group())) if m else None


def _arith_check(answer: str, reference: str) -> bool:
    return int(answer) == int(reference.strip())


def _gsm8k_extract(text: str) -> str | None:
    value = extract_gsm8k_answer(text)
    return None if value is None else repr(value)


def _gsm8k_check(answer: str, reference: str) -> bool:
    gold = extract_gsm8k_answer(reference)
    if gold is None:
        raise ValueError(f"gsm8k reference {reference!r} holds no number; fix the benchmark's reference field")
    return _numbers_equal(float(answer), gold)


def _math_extract(text: str) -> str | None:
    boxes = find_boxed(text)
    return boxes[-1].replace(" ", "") if boxes else None


def _math_check(answer: str, reference: str) -> bool:
    return math_rule(f"\\boxed{{{answer}}}", reference) == 1.0


def _choice_extract(text: str) -> str | None:
    for pattern in _CHOICE_RES:
        m = pattern.search(text)
        if m:
            return m.group(1).upper()
    return None


def _choice_check(answer: str, reference: str) -> bool:
    return answer.upper() == reference.strip().strip("()").upper()


FORMATS: dict[str, AnswerFormat] = {
    "arith": AnswerFormat(_arith_extract, _arith_check),
    "gsm8k": AnswerFormat(_gsm8k_extract, _gsm8k_check),
    "math": AnswerFormat(_math_extract, _math_check),
    "choice": AnswerFormat(_choice_extract, _choice_check),
}
