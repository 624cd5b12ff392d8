"""Rule rewards: arith, gsm8k (over the GSM8K test split), math (math-verify), boxed_format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamrft.rewards.rules import RULES, arith, boxed_format, extract_gsm8k_answer, find_boxed, gsm8k, math_rule

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gsm8k_test_sample.jsonl"
SHARED_TEST_SPLIT = Path("/work/shared/data/gsm8k/test.jsonl")


def test_the_rules_dict_names_every_rule_explicitly():
    assert set(RULES) == {"arith", "gsm8k", "math", "boxed_format"}


@pytest.mark.parametrize(
    "response, reference, expected",
    [
        ("42", "42", 1.0),
        ("The answer is -7.", "-7", 1.0),
        ("7", "-7", 0.0),
        ("12 then 42", "42", 0.0),  # the FIRST integer counts
        ("no digits here", "3", 0.0),
        ("0042", "42", 1.0),
    ],
)
def test_arith_compares_the_first_integer_of_the_response(response, reference, expected):
    assert arith(response, reference) == expected


def test_arith_rejects_a_reference_that_is_not_an_integer_naming_it():
    with pytest.raises(ValueError, match="'4.5'"):
        arith("4", "4.5")


def _gsm8k_rows(path: Path) -> list[tuple[str, str]]:
    rows = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        rows.append((row["answer"], row["answer"].rsplit("####", 1)[1].strip()))
    return rows


def _assert_gsm8k_rule_grades_split(rows: list[tuple[str, str]]) -> None:
    assert rows
    for solution, answer in rows:
        value = extract_gsm8k_answer(answer)
        wrong = f"{int(value) + 1:,}" if value == int(value) else str(value + 1)
        assert gsm8k(f"Reasoning...\n#### {answer}", answer) == 1.0, answer
        assert gsm8k(f"The answer is \\boxed{{{answer}}}", answer) == 1.0, answer
        assert gsm8k(solution, solution) == 1.0, answer  # full solution as reference
        assert gsm8k(f"Reasoning...\n#### {wrong}", answer) == 0.0, answer
        assert gsm8k(f"The answer is \\boxed{{{wrong}}}", answer) == 0.0, answer


def test_gsm8k_rule_grades_every_answer_of_the_fixture():
    _assert_gsm8k_rule_grades_split(_gsm8k_rows(FIXTURE))


@pytest.mark.skipif(
    not SHARED_TEST_SPLIT.exists(), reason="the full GSM8K test split is not at /work/shared/data/gsm8k"
)
def test_gsm8k_rule_grades_every_answer_of_the_full_test_split():
    rows = _gsm8k_rows(SHARED_TEST_SPLIT)
    assert len(rows) == 1319
    _assert_gsm8k_rule_grades_split(rows)


@pytest.mark.parametrize(
    "response, reference, expected",
    [
        ("so she makes $1,200.", "1200", 1.0),  # last number, comma and $ stripped
        ("#### $18.00", "18", 1.0),
        ("#### 18\nThen 3 more checks", "18", 1.0),  # #### wins over the last number
        ("\\boxed{18}, checked in 3 steps", "18", 1.0),  # a box wins over the last number
        ("I do not know", "18", 0.0),
        ("#### -4", "-4", 1.0),
    ],
)
def test_gsm8k_reads_the_final_answer_the_way_models_write_it(response, reference, expected):
    assert gsm8k(response, reference) == expected


@pytest.mark.parametrize(
    "response, reference, expected",
    [
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("so \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\sqrt{4}}", "2", 1.0),
        ("\\boxed{2x+1}", "1+2x", 1.0),
        ("\\boxed{3}", "0.5", 0.0),
        ("the answer is 0.5", "0.5", 0.0),  # no box, no reward
    ],
)
def test_math_rule_uses_math_verify_equivalence_on_the_boxed_answer(response, reference, expected):
    assert math_rule(response, reference) == expected


@pytest.mark.parametrize(
    "response, expected",
    [
        ("so \\boxed{12}.", 1.0),
        ("\\boxed{\\frac{1}{2}}", 1.0),  # nested braces are one box
        ("\\boxed{1} or \\boxed{2}", 0.0),
        ("no box", 0.0),
        ("\\boxed{unclosed", 0.0),
    ],
)
def test_boxed_format_wants_exactly_one_box_in_the_response(response, expected):
    assert boxed_format(response, "ignored") == expected


def test_find_boxed_returns_balanced_contents_in_order():
    assert find_boxed("\\boxed{a{b}} and \\boxed{c}") == ["a{b}", "c"]
