"""Verdict parsing of the generative judge."""

from __future__ import annotations

import pytest

from streamrft.rm.judge import parse_verdict


@pytest.mark.parametrize("text,verdict", [
    ("[[A]]", "A"), ("I think [[b]]", "B"), ("[[A]] no wait [[B]]", "B"), ("[[C]]", "tie"), ("[[tie]]", "tie"),
    ("[[7.5]]", 7.5), ("[[1]]", 1.0), ("A", None), ("[[maybe]]", None), ("[A]", None),
])
def test_the_last_double_bracket_verdict_is_parsed(text, verdict):
    assert parse_verdict(text) == verdict
