"""Issue 16 items 3 and 9 through the real command: a re-run with another algorithm is refused with the
diff before any model is loaded; a longer max_steps resumes; a torn steps.jsonl line is cut off on
resume; `make demo`'s script starts fresh every time (trains twice when run twice)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import REPO, arith_overrides

# one busy process at a time (pytest's, or one subprocess it waits on): `make test` runs it in the unit group
# (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.one_process]
CONFIG = REPO / "pipelines" / "arith" / "config.yaml"


def env() -> dict:
    out = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        out.pop(key, None)
    return out


def train(arith_dir, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "streamrft.cli", "train", str(CONFIG),
           *arith_overrides(arith_dir, out, "data.eval_path=", "checkpoint.save_every=1", *extra)]
    return subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=240)


def steps_of(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "steps.jsonl").read_text().splitlines()]


def test_item3_a_changed_algorithm_is_refused_before_model_load_and_max_steps_may_grow(arith_dir, tmp_path):
    out = tmp_path / "run"
    first = train(arith_dir, out, "train.max_steps=2", "algorithm.advantage_estimator=rloo")
    assert first.returncode == 0, first.stderr[-3000:]
    refused = train(arith_dir, out, "train.max_steps=2", "algorithm.advantage_estimator=rloo",
                    "algorithm.policy_loss=gspo")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.startswith(f"streamrft: error: {out / 'checkpoints' / 'step_00000002'} was saved by a run "
                                     "with other training settings")
    assert '  algorithm.policy_loss: "ppo_clip" -> "gspo"\n' in refused.stderr
    assert "Loading weights" not in refused.stdout + refused.stderr  # refused before any model load
    assert steps_of(out) == [1, 2]

    # a torn last line (the disk filled while logging) is cut off, and the run resumes with more steps
    with (out / "steps.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 0.1')
    longer = train(arith_dir, out, "train.max_steps=3", "algorithm.advantage_estimator=rloo")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert f"streamrft: {out / 'steps.jsonl'}: the last line (line 3) is torn" in longer.stdout
    assert f"resumed from {out / 'checkpoints' / 'step_00000002'} at step 2" in longer.stdout
    assert steps_of(out) == [1, 2, 3]

    never = train(arith_dir, out, "train.max_steps=3", "algorithm.advantage_estimator=rloo", "checkpoint.resume=never")
    assert never.returncode == 2
    assert "holds a checkpoint of an earlier run and checkpoint.resume=never; pass a new output_dir" in never.stderr


def test_item3_the_demo_starts_fresh_every_time(arith_dir, tmp_path):
    out = tmp_path / "rl"
    overrides = arith_overrides(arith_dir, out, "warmup.steps=150")
    cmd = [sys.executable, str(REPO / "pipelines" / "arith" / "demo.py"), str(CONFIG), *overrides]
    for attempt in range(2):
        proc = subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "resumed from" not in proc.stdout
        assert ("demo: removed the previous run" in proc.stdout) == (attempt == 1)
        assert steps_of(out) == [1]  # trained again, not "resumed" at the end


def test_prepare_on_a_prepared_folder_loads_neither_torch_nor_the_model(arith_dir):
    """launch/colocate.sh runs the arith prepare.py before every arith run: on a folder prepared already it only
    says where things are. (It used to import torch and transformers first: ~5 s of every launch.)"""
    overrides = [f"model.path={arith_dir / 'sft'}", f"data.train_path={arith_dir / 'train.jsonl'}",
                 f"data.eval_path={arith_dir / 'eval.jsonl'}"]
    proc = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "pipelines" / "arith" / "prepare.py"),
                           "--config", str(CONFIG), *overrides], env=env(), cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["model_dir"] == str(arith_dir / "sft")
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "streamrft.config" in imported and not imported & {"torch", "transformers"}
