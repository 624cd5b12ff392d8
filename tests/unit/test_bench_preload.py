"""benchmarks/preload_bench.py: the preload/none ratios are of the medians of each mode's runs."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from preload_bench import ratios, train_args  # noqa: E402


def test_ratios_divide_the_preload_median_by_the_none_median():
    rows = [{"mode": "preload", "step1_s": 4.0, "wall_s": 18.0}, {"mode": "none", "step1_s": 6.0, "wall_s": 20.0},
            {"mode": "preload", "step1_s": 5.0, "wall_s": 19.0}, {"mode": "none", "step1_s": 7.0, "wall_s": 21.0},
            {"mode": "preload", "step1_s": 9.0, "wall_s": 30.0}, {"mode": "none", "step1_s": 6.5, "wall_s": 20.5}]
    assert ratios(rows) == {"step1_s": 5.0 / 6.5, "wall_s": 19.0 / 20.5}


def test_the_async_runs_use_an_engine_process_and_both_compile_the_layers():
    args = train_args(Path("/d/arith"), Path("/o"), "async")
    assert "rollout.placement=async" in args and "train.compile_layers=true" in args
    assert "compile_cache_dir=/d/compile_cache" in args
    assert not any(a.startswith("rollout.placement") for a in train_args(Path("/d/arith"), Path("/o"), "colocated"))
