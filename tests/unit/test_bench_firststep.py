"""benchmarks/bench_firststep.py: the first step's parts are the differences of the marks and the first/steady
calls recorded (checked on made-up numbers), and Stamps times sync and async functions, methods and
constructors without changing what they return."""

import asyncio
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_firststep import COLUMNS, Stamps, breakdown, first_step_table  # noqa: E402


def test_breakdown_from_marks_and_calls():
    marks = {"launch": 100.0, "main": 100.25, "config_loaded": 100.75, "imports_done": 106.5, "dist_ready": 107.0,
             "validated": 110.0, "build_run_end": 150.0, "rollout_start": 151.5, "train_end": 200.0}
    calls = {"build_run": [40.0], "build_learner": [30.0], "build_engine": [2.0], "rollout": [20.0, 5.0, 7.0],
             "decoder_init": [1.5, 0.5, 0.25], "capture": [12.0, 0.75, 0.5], "train": [25.0, 10.0, 12.0, 14.0]}
    row = {"phase/weight_push_seconds": 0.125, "step_seconds": 46.0, "phase/train_to_rollout_seconds": 0.5,
           "phase/rollout_to_train_seconds": 0.25, "compile_seconds": 9.5}
    b = breakdown(marks, calls, row)
    assert b["process_start_s"] == pytest.approx(0.25)
    assert b["imports_s"] == pytest.approx(5.75)
    assert b["config_s"] == pytest.approx(0.5) and b["dist_init_s"] == pytest.approx(0.5)
    assert b["validate_s"] == pytest.approx(3.0)
    assert b["model_load_s"] == 30.0 and b["engine_build_s"] == 2.0 and b["build_other_s"] == pytest.approx(8.0)
    assert b["loop_start_s"] == pytest.approx(1.5)
    assert b["first_rollout_s"] == 20.0 and b["steady_rollout_s"] == 6.0 and b["first_rollout_extra_s"] == 14.0
    assert b["decoder_init_first_s"] == 1.5 and b["decoder_init_steady_s"] == pytest.approx(0.375)
    assert b["capture_first_s"] == 12.0 and b["capture_steady_s"] == pytest.approx(0.625)
    assert b["first_train_s"] == 25.0 and b["steady_train_s"] == 12.0 and b["first_train_extra_s"] == 13.0
    assert b["first_weight_sync_s"] == 0.125 and b["first_step_s"] == 46.0 and b["first_compile_s"] == 9.5
    assert b["launch_to_first_step_s"] == pytest.approx(100.0)
    # a run without CUDA graphs or a launch mark: those parts are None, not 0
    b2 = breakdown({"main": 1.0, "config_loaded": 1.5, "imports_done": 2.0}, {"train": [3.0]}, {})
    assert b2["capture_first_s"] is None and b2["process_start_s"] is None and b2["steady_train_s"] is None
    assert b2["first_train_extra_s"] is None and b2["build_other_s"] is None
    table = first_step_table([{"size": "0.5b", "system": "streamrft", "cache": "cold", "first_step": b,
                               "inductor_cache": {"fxgraph_cache_miss": 3}}])
    row_cells = table.splitlines()[2].split()
    assert row_cells[:3] == ["0.5b", "streamrft", "cold"] and row_cells[-3:] == ["0/3", "off", "off"]
    assert row_cells[3:3 + len(COLUMNS)][3] == "30.00"  # model column
    assert row_cells[3 + [c for c, _ in COLUMNS].index("t2r1")] == "0.50"  # the switch that ends step 1
    warmed = first_step_table([{"size": "0.5b", "system": "streamrft", "cache": "cold", "first_step": b,
                                "inductor_cache": {"fxgraph_cache_hit": 3},
                                "compile_warmup": {"status": "ok", "wall_s": 21.04, "waited_s": 2.5},
                                "kernel_warmup": {"status": "ok", "wall_s": 14.26, "launches": 24}}])
    assert warmed.splitlines()[2].endswith("3/0  ok 21.0s, waited 2.5s  ok 14.3s")
    logged = first_step_table([{"size": "0.5b", "system": "streamrft", "cache": "cold", "first_step": b,
                                "compile_warmup": {"status": "ok", "wall_s": 25.4, "waited_s": 10.2, "imports_s": 9.28,
                                                   "compile_log": [["train.compile_layers", 6.04], ["other", 0.5],
                                                                   ["train.compile_head", 2.0],
                                                                   ["train.compile_layers", 1.02]]}}])
    assert logged.splitlines()[2].endswith(
        "ok 25.4s (imports 9.3, compile_layers 7.1, other 0.5, compile_head 2.0), waited 10.2s  off")
    # a child that reports its CUDA context and its step's seconds: the running outside the compiles is the rest
    timed = first_step_table([{"size": "0.5b", "system": "streamrft", "cache": "cold", "first_step": b,
                               "compile_warmup": {"status": "ok", "wall_s": 31.09, "waited_s": 11.24, "imports_s": 11.02,
                                                  "device_s": 3.14, "seconds": 16.6, "compile_seconds": 11.89,
                                                  "compile_pool_started_s": 5.06,
                                                  "compile_pool_ready_s": 8.44, "backward_s": 1.06,
                                                  "compiling_at_s": 14.5, "cuda_preinit": "ok",
                                                  "cuda_preinit_s": 2.93,
                                                  "compile_log": [["train.compile_layers", 9.75],
                                                                  ["train.compile_head", 1.14],
                                                                  ["train.compile_head", 1.0]]}}])
    assert timed.splitlines()[2].endswith(
        "ok 31.1s (imports 11.0, device 3.1, context 2.9 beside the imports, compile_layers 9.8, compile_head 2.1, running 4.7 of which backward 1.1, "
        "compiling at 14.5, workers started at 5.1, workers ready at 8.4), waited 11.2s  off")


def test_stamps_time_functions_methods_and_constructors():
    synced = []
    st = Stamps(sync=lambda: synced.append(1))

    class Box:
        def __init__(self, v):
            time.sleep(0.02)
            self.v = v

        async def get(self):
            await asyncio.sleep(0.02)
            return self.v

    st.wrap(Box, "__init__", "init")
    box = Box(7)
    st.wrap(box, "get", "get")
    assert box.v == 7 and asyncio.run(box.get()) == 7 and asyncio.run(box.get()) == 7
    assert len(st.calls["init"]) == 1 and st.calls["init"][0] >= 0.02
    assert len(st.calls["get"]) == 2 and min(st.calls["get"]) >= 0.02
    assert len(synced) == 6  # before and after each of the three calls
    assert st.marks["get_start"] <= st.marks["get_end"]  # the first call's marks are kept
    first_end = st.marks["get_end"]
    asyncio.run(box.get())
    assert st.marks["get_end"] == first_end

    def boom():
        raise KeyError("x")

    holder = type("H", (), {"f": staticmethod(boom)})
    st.wrap(holder, "f", "boom", sync=False)
    with pytest.raises(KeyError):
        holder.f()
    assert len(st.calls["boom"]) == 1  # a failed call is still timed


@pytest.mark.slow
def test_a_tiny_run_reports_every_part_of_its_first_step(tmp_path):
    """gpu_grpo.py --tiny end to end (one StreamRFT run, a variant with no overrides): the result holds the
    breakdown, the parts that exist on a CPU are measured, CUDA-only ones are None, and the tables are written."""
    import json
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(root / "benchmarks" / "gpu_grpo.py"), "--tiny", "--systems", "streamrft", "--steps",
           "2", "--variants", "base", "--out", str(tmp_path / "out"), "--report-dir", str(tmp_path / "rep")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "res_tiny_streamrft-base.json").read_text())
    assert "error" not in res, res.get("error")
    fs = res["first_step"]
    assert {k for _, k in COLUMNS} <= set(fs)
    measured = ["process_start_s", "imports_s", "validate_s", "model_load_s", "engine_build_s", "build_other_s",
                "loop_start_s", "first_rollout_s", "steady_rollout_s", "decoder_init_first_s", "first_train_s",
                "steady_train_s", "first_weight_sync_s", "first_step_s", "launch_to_first_step_s"]
    assert all(fs[k] is not None and fs[k] >= 0 for k in measured), {k: fs[k] for k in measured}
    assert fs["capture_first_s"] is None  # no CUDA graphs on a CPU
    assert fs["first_compile_s"] == 0.0  # nothing compiled on a CPU by default (a key the run logged, not None)
    parts = fs["process_start_s"] + fs["imports_s"] + fs["validate_s"] + fs["build_run_s"] + fs["first_train_s"]
    assert fs["launch_to_first_step_s"] >= parts
    assert res["cache"] == "cold" and res["variant"] == "base" and res["steps"] == 2
    assert "torch" not in res["imports_from_source"]  # this venv's pip install wrote torch's .pyc files
    table = (tmp_path / "rep" / "table.txt").read_text()
    assert "memory options (--variants)" in table and "first step, seconds" in table
    assert json.loads((tmp_path / "rep" / "results.json").read_text())["tiny_streamrft-base"]["system"] == \
        "streamrft-base"


def test_the_table_notes_a_run_that_imported_its_packages_from_source():
    b = breakdown({"main": 1.0, "config_loaded": 1.5, "imports_done": 2.0}, {"train": [3.0]}, {})
    row = {"size": "0.5b", "system": "streamrft", "cache": "cold", "first_step": b}
    assert "note:" not in first_step_table([row, {**row, "imports_from_source": []}])
    noted = first_step_table([{**row, "imports_from_source": ["torch", "transformers"]}]).splitlines()[-1]
    assert noted.startswith("note: 0.5b streamrft compiled torch, transformers from source")
