"""pass@k (unbiased, Chen et al. 2021), majority voting and answer extraction per format."""

from __future__ import annotations

import itertools
from math import comb

import pytest

from streamrft.evaluate.answers import FORMATS
from streamrft.evaluate.metrics import majority_answer, pass_at_k


@pytest.mark.parametrize("n,c,k", [(10, 3, 1), (10, 3, 5), (10, 0, 4), (10, 10, 1), (20, 2, 19), (5, 4, 2)])
def test_pass_at_k_equals_one_minus_the_binomial_ratio(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_pass_at_k_equals_the_share_of_k_subsets_with_a_correct_sample():
    correct = [1, 0, 0, 1, 0, 0]
    subsets = list(itertools.combinations(correct, 3))
    assert pass_at_k(6, 2, 3) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_rejects_k_above_n():
    with pytest.raises(ValueError, match="n=3, c=1, k=4"):
        pass_at_k(3, 1, 4)


def test_majority_vote_ignores_missing_answers_and_breaks_ties_by_first_occurrence():
    assert majority_answer([None, "3", "4", "4", "3", None, None]) == "3"
    assert majority_answer(["5", None, "7", "7"]) == "7"
    assert majority_answer([None, None]) is None


@pytest.mark.parametrize("fmt,text,answer", [
    ("arith", "19", "19"), ("arith", " -3 and 4", "-3"), ("arith", "", None),
    ("gsm8k", "so 3 + 4 = 7\n#### 1,200", "1200.0"), ("gsm8k", "no digits", None),
    ("math", "thus \\boxed{\\frac{1}{2}} ok", "\\frac{1}{2}"),
    ("choice", "The answer is (B).", "B"), ("choice", "C) because", "C"), ("choice", "so it is D", "D"),
    ("choice", "Because of this", None),
])
def test_answers_are_extracted_per_format(fmt, text, answer):
    assert FORMATS[fmt].extract(text) == answer


def test_answers_are_checked_against_references_per_format():
    assert FORMATS["gsm8k"].check("1200.0", "work ... #### 1,200")
    assert FORMATS["math"].check("\\frac{1}{2}", "0.5")
    assert not FORMATS["math"].check("2", "0.5")
    assert FORMATS["choice"].check("b", "(B)")
    assert FORMATS["arith"].check("7", " 7")


def test_the_shipped_eval_config_loads_and_names_real_fields():
    import json
    from pathlib import Path

    from streamrft.evaluate.config import load_eval_config

    root = Path(__file__).resolve().parents[2]
    cfg = load_eval_config(root / "pipelines" / "math_eval" / "gsm8k.yaml", ["n=4", "k=2"])
    assert (cfg.format, cfg.n, cfg.k) == ("gsm8k", 4, 2)
    first = json.loads((root / cfg.data_path).read_text().splitlines()[0])
    assert FORMATS[cfg.format].check(FORMATS[cfg.format].extract(first[cfg.reference_key]), first[cfg.reference_key])
    assert "{prompt}" in cfg.prompt_template and cfg.prompt_key in first
