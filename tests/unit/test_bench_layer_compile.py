"""benchmarks/layer_compile.py: a variant's first-step ratio to its baseline per cache state, and a failed worker
(an error row) leaves its cache state out instead of dividing by something it did not measure."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from layer_compile import ratios  # noqa: E402


def test_ratios_divide_specialised_by_symbolic_per_cache_state():
    rows = [{"variant": "symbolic", "cache": "cold", "first_step_s": 60.0},
            {"variant": "symbolic", "cache": "warm", "first_step_s": 20.0},
            {"variant": "specialised", "cache": "cold", "first_step_s": 45.0},
            {"variant": "specialised", "cache": "warm", "first_step_s": 12.0}]
    assert ratios(rows) == {"cold": 0.75, "warm": 0.6}


def test_an_error_row_leaves_its_cache_state_out():
    rows = [{"variant": "symbolic", "cache": "cold", "first_step_s": 60.0},
            {"variant": "specialised", "cache": "cold", "error": "timed out after --timeout 900 s"},
            {"variant": "symbolic", "cache": "warm", "first_step_s": 20.0},
            {"variant": "specialised", "cache": "warm", "first_step_s": 10.0}]
    assert ratios(rows) == {"warm": 0.5}


def test_batch_over_specialised_is_the_second_comparison():
    rows = [{"variant": "symbolic", "cache": "cold", "first_step_s": 60.0},
            {"variant": "specialised", "cache": "cold", "first_step_s": 40.0},
            {"variant": "batch", "cache": "cold", "first_step_s": 10.0},
            {"variant": "batch", "cache": "warm", "first_step_s": 3.0}]
    assert ratios(rows, "batch", "specialised") == {"cold": 0.25}
    assert ratios(rows) == {"cold": 40.0 / 60.0}
