"""Bitwise determinism (issue 16 item 8): samples are trained in canonical order (prompt, sample), not
in arrival order, so identical deterministic runs, and runs killed and resumed at random points, give
identical losses."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.conftest import REPO

pytestmark = pytest.mark.slow

CONFIG = str(REPO / "pipelines" / "arith" / "config.yaml")
STEPS = 20


def command(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "streamrft.cli", "train", CONFIG, f"model.path={model_dir / 'sft'}",
            f"data.train_path={model_dir / 'train.jsonl'}", "data.eval_path=", f"output_dir={out}",
            "metrics.progress=false", "rollout.prompts_per_step=8", "rollout.n_samples_per_prompt=8",
            "rollout.stage_timeout_s=60", f"train.max_steps={STEPS}", "train.deterministic=true",
            "checkpoint.save_every=1", *extra]


ENV = dict(os.environ, OMP_NUM_THREADS="1")


def losses(out: Path) -> list[str]:
    """Each step's loss and grad norm as exact hex strings, from the last line logged for each step."""
    by_step = {}
    for line in (out / "steps.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step[row["step"]] = (float(row["loss"]).hex(), float(row["grad_norm"]).hex())
    return [by_step[s] for s in sorted(by_step)]


def deterministic_run(model_dir: Path, out: Path) -> list[str]:
    """One uninterrupted deterministic run without checkpoints; its per-step losses."""
    proc = subprocess.run(command(model_dir, out, "checkpoint.save_every=0"), cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return losses(out)


@pytest.fixture(scope="module")
def uninterrupted(warm_arith, tmp_path_factory) -> list[str]:
    """The first of the five identical runs, and the uninterrupted run the killed-and-resumed one must equal
    (run once for both tests: a 20-step run is ~10 s of the suite)."""
    return deterministic_run(warm_arith, tmp_path_factory.mktemp("uninterrupted"))


def test_item8_five_identical_deterministic_runs_give_identical_losses(warm_arith, tmp_path, uninterrupted):
    # two runs at a time: each is one single-threaded process, and CI's machine has two cores (the runs being
    # bitwise equal under different timing is the point of the test)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = [uninterrupted, *pool.map(lambda i: deterministic_run(warm_arith, tmp_path / f"run{i}"), range(1, 5))]
    assert len(results[0]) == STEPS
    assert any(float.fromhex(loss) != 0.0 for loss, _ in results[0]), "every loss is 0: the test could not fail"
    for other in results[1:]:
        assert other == results[0]


def last_logged_step(out: Path) -> int:
    """The highest step in steps.jsonl so far (0 before the first); a line still being written is skipped."""
    try:
        text = (out / "steps.jsonl").read_text()
    except FileNotFoundError:
        return 0
    steps = [0]
    for line in text.splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            pass
    return max(steps)


def kill_after_progress(proc: subprocess.Popen, out: Path, steps_ahead: int, delay_s: float) -> bool:
    """SIGKILL `proc` `delay_s` after it has logged `steps_ahead` more steps (0: during its start-up);
    False if it finished first. Aiming at progress, not at wall time, keeps the kills inside the run
    on any machine speed (CI once finished the whole run between two time-based kills)."""
    target = last_logged_step(out) + steps_ahead
    deadline = time.monotonic() + 120
    while last_logged_step(out) < target:
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, f"no progress to step {target} within 120 s"
        time.sleep(0.02)
    time.sleep(delay_s)
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    return True


# one busy process at a time: `make test` runs it in the unit group (tests/conftest.py)
@pytest.mark.one_process
def test_item8_ten_random_sigkills_and_resumes_give_the_uninterrupted_losses(warm_arith, tmp_path, uninterrupted):
    out = tmp_path / "killed"
    rng = random.Random(0)
    kills = 0
    # each kill lands 0-1 logged steps into its run (0: during start-up, before the resumed run's first step)
    # and up to 0.1 s later, so the kills hit start-up, mid-step and mid-save points; on this machine the ten
    # kills end near step 8 of 20, which leaves room for a faster machine
    while kills < 10:
        proc = subprocess.Popen(command(warm_arith, out), cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        if not kill_after_progress(proc, out, rng.randint(0, 1), rng.uniform(0.0, 0.1)):
            break  # the run finished before this kill
        kills += 1
    proc = subprocess.run(command(warm_arith, out), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert kills == 10, f"only {kills} kills landed before the run finished"
    assert losses(out) == uninterrupted
