"""Rule rewards: pure functions ``(response, reference) -> reward`` picked by name from :data:`RULES`.

Every rule reads the RESPONSE only (never the prompt), so a prompt that itself contains ``####`` or
``\\boxed{}`` cannot leak a reward. Imports stay light (no torch): a reward microservice needs
msgspec + pyzmq, and math-verify is imported on first use of the ``math`` rule.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Callable

_INT_RE = re.compile(r"-?\d+")
# A number as models write it: optional sign and '$', digits with optional thousands commas, decimals.
_NUMBER_RE = re.compile(r"-?\$?\s?\d[\d,]*(?:\.\d+)?|-?\$?\s?\.\d+")
_BOXED_OPEN = "\\boxed{"


def find_boxed(text: str) -> list[str]:
    """Contents of every balanced ``\\boxed{...}`` in ``text``, in order (nested braces allowed)."""
    found: list[str] = []
    start = text.find(_BOXED_OPEN)
    while start != -1:
        i = start + len(_BOXED_OPEN)
        depth = 1
        j = i
        while j < len(text) and depth:
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
            j += 1
        if depth:  # unbalanced: no closing brace, so nothing after it can be a complete box either
            break
        found.append(text[i : j - 1])
        start = text.find(_BOXED_OPEN, j)
    return found


def parse_number(text: str) -> float | None:
    """A number written as ``$1,234.50`` or ``-7`` or ``18.``; None when ``text`` is not one number."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    if not cleaned:
        return None
    try:
        return float(cleaned)
    except ValueError:
        return None


def _last_number(text: str) -> float | None:
    for match in reversed(_NUMBER_RE.findall(text)):
        value = parse_number(match)
        if value is not None:
            return value
    return None


def _numbers_equal(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def arith(response: str, reference: str) -> float:
    """1.0 when the first integer in the response (a leading '-' allowed) equals the reference integer."""
    try:
        expected = int(reference.strip())
    except ValueError:
        raise ValueError(
            f"arith rule: reference {reference!r} is not an integer; fix the dataset's reference field"
        ) from None
    match = _INT_RE.search(response)
    return 1.0 if match is not None and int(match.group()) == expected else 0.0


def extract_gsm8k_answer(text: str) -> float | None:
    """The final numeric answer of a GSM8K-style text.

    Order: the number right after the last ``####``; else the last ``\\boxed{}`` holding a number;
    else the last number anywhere. ``\\boxed{}`` comes before "last number" because it is an explicit
    answer marker, while text after a box ("... \\boxed{18}, checked in 3 steps") must not win.
    """
    if "####" in text:
        tail = text.rsplit("####", 1)[1]
        match = _NUMBER_RE.search(tail)
        return parse_number(match.group()) if match else None
    for content in reversed(find_boxed(text)):
        value = parse_number(content)
        if value is not None:
            return value
    return _last_number(text)


def gsm8k(response: str, reference: str) -> float:
    """1.0 when the response's final answer equals the reference numerically (commas and '$' ignored).

    ``reference`` may be the bare answer ("1,200") or a full GSM8K solution ending in ``#### 1,200``.
    """
    expected = extract_gsm8k_answer(reference)
    if expected is None:
        raise ValueError(f"gsm8k rule: reference {reference!r} holds no number; fix the dataset's reference field")
    got = extract_gsm8k_answer(response)
    return 1.0 if got is not None and _numbers_equal(got, expected) else 0.0


def _math_verify_timeouts() -> dict[str, int | None]:
    # math-verify enforces its timeouts with signal.alarm, which only works in the main thread; elsewhere
    # (the scorer's worker threads) the caller's own timeout bounds the work instead.
    on_main = threading.current_thread() is threading.main_thread()
    return {"parsing_timeout": 5 if on_main else None}


def math_rule(response: str, reference: str) -> float:
    """1.0 when the last ``\\boxed{}`` of the response is mathematically equivalent to the reference
    (math-verify's parse + verify: ``\\frac{1}{2}`` equals ``0.5``, ``\\sqrt{4}`` equals ``2``)."""
    from math_verify import parse, verify  # heavy (sympy): imported on first use only

    boxes = find_boxed(response)
    if not boxes:
        return 0.0
    parse_kw = _math_verify_timeouts()
    verify_timeout = 5 if parse_kw["parsing_timeout"] else None
    predicted = parse(f"$\\boxed{{{boxes[-1]}}}$", **parse_kw)
    # A bare reference ("1+2x") is read as LaTeX: plain-expression parsing would stop at "2x".
    as_latex = reference if "$" in reference or "\\boxed" in reference else f"${reference}$"
    gold = parse(as_latex, **parse_kw) or parse(reference, **parse_kw)
    if not gold:
        raise ValueError(
            f"math rule: math-verify cannot parse reference {reference!r}; fix the dataset's reference field"
        )
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=verify_timeout) else 0.0


def boxed_format(response: str, reference: str) -> float:
    """Format rule: 1.0 when the response holds exactly one balanced ``\\boxed{...}``; the reference is unused."""
    del reference
    return 1.0 if len(find_boxed(response)) == 1 and response.count(_BOXED_OPEN) == 1 else 0.0


RULES: dict[str, Callable[[str, str], float]] = {
    "arith": arith,
    "gsm8k": gsm8k,
    "math": math_rule,
    "boxed_format": boxed_format,
}
