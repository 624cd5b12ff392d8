"""rollout.placement=async (issue 15): engine processes generate while the learner trains, weights
published by version and loaded between decode chunks. Real processes: the learner (1 rank, or 2 under
torchrun on gloo) and its engine processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import REPO, arith_eval_overrides
from tests.ports import free_port

pytestmark = pytest.mark.slow

CONFIG = str(REPO / "pipelines" / "arith" / "config.yaml")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def base(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return [f"model.path={model_dir / 'sft'}", f"data.train_path={model_dir / 'train.jsonl'}",
            f"data.eval_path={model_dir / 'eval.jsonl'}", "data.eval_size=64", f"output_dir={out}",
            "metrics.progress=false", "rollout.prompts_per_step=16", "rollout.n_samples_per_prompt=8",
            "rollout.stage_timeout_s=60", "checkpoint.save_every=0", *extra]


def run(model_dir: Path, out: Path, *extra: str, ranks: int = 1, timeout: int = 600) -> dict:
    if ranks == 1:
        cmd = [sys.executable, "-m", "streamrft.cli", "train", CONFIG, *base(model_dir, out, *extra)]
        env = ENV
    else:
        cmd = [str(REPO / "launch" / "colocate.sh"), CONFIG, *base(model_dir, out, *extra)]
        env = dict(ENV, NPROC_PER_NODE=str(ranks), MASTER_PORT=str(free_port()))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.split("summary: ", 1)[1].splitlines()[0])


def trained_records(out: Path) -> list[dict]:
    rows = [json.loads(line) for f in sorted((out / "traj").glob("*.jsonl")) for line in f.read_text().splitlines()]
    return [r for r in rows if r["status"] == "trained"]


def check_versions(out: Path, max_staleness: int, n_expected: int) -> list[dict]:
    trained = trained_records(out)
    assert len(trained) == n_expected
    for r in trained:
        assert len(r["token_versions"]) == len(r["response_ids"])
        assert min(r["token_versions"]) >= r["learner_version"] - max_staleness, r["sample_id"]
    return trained


def reward_curve(out: Path) -> list[float]:
    return [json.loads(line)["reward_mean"] for line in (out / "steps.jsonl").read_text().splitlines()]


# 40 steps: held-out accuracy rises from 0.100 to 0.154 (colocated) and 0.158 (async, 1 and 2 learners) in a local
# run, as much as 60 steps gave (0.145), in two thirds of CI's longest test
STEPS = 40
# decode in chunks of 16 rows: generation then takes about as long as a train step, as on GPUs where generation
# dominates (the tiny model's whole-step decode on CPU is several times faster than its update)
LEARNING = [f"train.max_steps={STEPS}", "rollout.max_staleness=1", "rollout.prompts_per_step=32",
            "engine.max_batch_size=16"]


# Held-out accuracy near 0.1-0.15 on 64 rows moves in steps of 1.6 points, and two runs' greedy answers differ by
# several rows by chance: CI once saw 0.156 (colocated) against 0.094 (async). 512 rows of the same held-out split
# measure it to about 1.5 points (local runs: async 0.127-0.135 against colocated 0.135; 0.160 and 0.168 against
# 0.168), so the 5-point bound tests learning, not luck.
WIDE_EVAL_ROWS = 512


@pytest.fixture(scope="module")
def wide_eval(warm_arith) -> list[str]:
    # beside the model: launch/colocate.sh checks that the arith data sits in the prepared folder
    return arith_eval_overrides(warm_arith, WIDE_EVAL_ROWS)


@pytest.fixture(scope="module")
def colocated_run(warm_arith, wide_eval, tmp_path_factory) -> tuple[dict, list[float]]:
    """The colocated baseline, once: one rank (the first step's loss is the same on 1, 2 or 3 ranks:
    tests/integration/test_train_e2e.py), staleness 1 like the async runs."""
    out = tmp_path_factory.mktemp("colocated")
    return run(warm_arith, out, *LEARNING, *wide_eval), reward_curve(out)


@pytest.mark.parametrize("learners", [1, 2])
def test_async_learns_like_colocated_within_the_staleness_bound(warm_arith, wide_eval, tmp_path, learners, colocated_run):
    """STEPS steps async (staleness 1) against the colocated baseline: the training reward rises, held-out
    accuracy ends within 5 points, every trained token is at most one version behind, and engine and
    learner are busy at the same time."""
    colocated, colocated_curve = colocated_run
    out = tmp_path / "async"
    summary = run(warm_arith, out, *LEARNING, *wide_eval, "rollout.placement=async", "rollout.engine_ranks=1",
                  f"sinks.jsonl={out / 'traj'}", ranks=learners)
    print("colocated", colocated, "\nasync", summary)
    for curve in (colocated_curve, reward_curve(out)):
        assert sum(curve[-20:]) / 20 > sum(curve[:10]) / 10 + 0.02, curve
    assert abs(summary["heldout_accuracy_after"] - colocated["heldout_accuracy_after"]) <= 0.05
    # rank 0's share: its own trained samples (the groups routed to it) and nothing lost
    assert summary["samples_admitted"] == summary["samples_trained"] == STEPS * 32 * 8 // learners
    check_versions(out, 1, STEPS * 32 * 8)
    # Both busy at once (not taking turns). The target is >= 0.5; on the 2-core CPU, where the engine
    # process, the learner and the scoring share two cores, the learner is busy a fifth to a third of the wall
    # time and both 0.11-0.32 (benchmarks/NOTES.md, async placement on CPU), a fixed floor on "both" fails by
    # chance; this bound only checks that they overlap: at least a quarter of the learner's busy time has the
    # engine busy too (0.51-0.76 measured; taking turns gives 0). The GPU benchmark reports the fraction where
    # it matters.
    both, learner_busy = summary["async_both_busy_fraction"], summary["async_learner_busy_fraction"]
    assert learner_busy > 0 and both >= 0.25 * learner_busy, summary


def test_a_weight_update_lands_mid_generation_and_rows_keep_their_tokens(warm_arith, tmp_path):
    """Long responses (no EOS) and a learner that publishes while the engine decodes: some trained rows
    carry two versions (the switch happened inside the row)."""
    out = tmp_path / "async"
    summary = run(warm_arith, out, "train.max_steps=6", "rollout.max_staleness=1", "rollout.placement=async",
                  "engine.max_new_tokens=24", "engine.ignore_eos=true", "engine.max_batch_size=16",
                  f"sinks.jsonl={out / 'traj'}", "data.eval_path=")
    trained = check_versions(out, 1, 6 * 16 * 8)
    mixed = [r for r in trained if len(set(r["token_versions"])) > 1]
    assert mixed, "no row saw a weight update mid-generation"
    for r in mixed:  # versions only move forward within a row
        assert r["token_versions"] == sorted(r["token_versions"])
    assert summary["samples_trained"] == 6 * 16 * 8


def test_replay_of_a_20_step_async_run_is_bitwise(warm_arith, tmp_path):
    out = tmp_path / "async"
    run(warm_arith, out, "train.max_steps=20", "rollout.max_staleness=1", "rollout.placement=async",
        "train.record_batches=true", "train.deterministic=true", "data.eval_path=")
    proc = subprocess.run([sys.executable, "-m", "streamrft.cli", "replay", str(out)], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "replay: steps=20 bitwise_equal=true" in proc.stdout


def test_kill_9_of_the_engine_fails_the_learner_naming_the_engine_rank(warm_arith, tmp_path):
    out = tmp_path / "async"
    cmd = [sys.executable, "-m", "streamrft.cli", "train", CONFIG,
           *base(warm_arith, out, "train.max_steps=200", "rollout.placement=async", "data.eval_path=",
                 "rollout.stage_timeout_s=30")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("step 3/"):
                break
        engine_pid = json.loads((out / "engines" / "engine0.pid").read_text())
        os.kill(engine_pid, signal.SIGKILL)
        killed = time.monotonic()
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode not in (0, None)
    assert time.monotonic() - killed < 30
    assert "engine rank 0" in rest and "killed by signal 9" in rest, rest[-2000:]
    steps = [json.loads(line)["step"] for line in (out / "steps.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)), "a step was trained twice"
