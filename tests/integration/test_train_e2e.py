"""End-to-end training runs on the embedded default: real model, real channels, real torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamrft.config import load_config
from tests.integration.conftest import REPO, arith_overrides, sigterm_after_step
from tests.ports import free_port

pytestmark = pytest.mark.slow
CONFIG = REPO / "pipelines" / "arith" / "config.yaml"


def steps_of(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "steps.jsonl").read_text().splitlines()]


def run_in_process(arith_dir, out, *extra):
    from streamrft.compose import train

    return train(load_config(CONFIG, arith_overrides(arith_dir, out, *extra)))


def env_one_thread() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


@pytest.mark.parametrize("transport", ["inproc", "ipc", "tcp"])
def test_first_step_has_importance_ratio_one_and_zero_kl(arith_dir, tmp_path, transport):
    summary = run_in_process(arith_dir, tmp_path, "algorithm.kl_coef=0.05", f"rollout.channel_transport={transport}")
    (first,) = steps_of(tmp_path)
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert abs(first["kl"]) <= 1e-6
    assert summary["samples_admitted"] == summary["samples_trained"] == 8 * 4


def test_first_step_ratio_is_exactly_one_when_old_logprobs_are_recomputed(arith_dir, tmp_path):
    run_in_process(arith_dir, tmp_path, "train.ppo_epochs=2", "algorithm.kl_coef=0.05")
    (first,) = steps_of(tmp_path)
    # ppo_epochs=2: the learner recomputes old log-probs; the first pass sees ratio 1 exactly, so the
    # clipped fraction over both passes is at most half of the tokens and KL starts at 0.
    assert first["clip_fraction"] <= 0.5
    assert first["kl"] >= 0.0


# 6 prompts split evenly over 2 and 3 ranks: one one-rank reference serves both rank counts
PROMPTS = 6


@pytest.fixture(scope="module")
def one_rank_first_step(arith_dir, tmp_path_factory) -> dict:
    """The first step of the one-rank run (the CLI, one process) that every rank count must reproduce."""
    one = tmp_path_factory.mktemp("one_rank")
    subprocess.run([sys.executable, "-m", "streamrft.cli", "train", str(CONFIG),
                    *arith_overrides(arith_dir, one, f"rollout.prompts_per_step={PROMPTS}")],
                   check=True, env=env_one_thread(), timeout=300, cwd=REPO)
    (a,) = steps_of(one)
    return a


@pytest.mark.parametrize("ranks", [2, 3])
def test_more_ranks_give_the_same_first_step_loss_as_one_rank(arith_dir, tmp_path, ranks, one_rank_first_step):
    """Same global batch, same seed: sampling is seeded per (step, prompt, sample) and the loss is
    normalised by global counts, so the first step cannot depend on the number of ranks."""
    many = tmp_path / "many"
    env = dict(env_one_thread(), NPROC_PER_NODE=str(ranks), MASTER_PORT=str(free_port()))
    proc = subprocess.run([str(REPO / "launch" / "colocate.sh"), str(CONFIG),
                           *arith_overrides(arith_dir, many, f"rollout.prompts_per_step={PROMPTS}")],
                          env=env, timeout=300, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a, (b,) = one_rank_first_step, steps_of(many)
    assert b["train_sequences"] == a["train_sequences"] == PROMPTS * 4
    assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-9)
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-4)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-6)


def test_sigterm_stops_training_cleanly_with_a_message(arith_dir, tmp_path):
    overrides = arith_overrides(arith_dir, tmp_path, "train.max_steps=1000")
    code, out = sigterm_after_step([sys.executable, "-m", "streamrft.cli", "train", str(CONFIG), *overrides],
                                   env_one_thread(), step=1)
    assert code == 130
    assert "stopped by SIGTERM on rank 0; sockets closed" in out


def test_sigterm_to_torchrun_stops_both_ranks_and_leaves_no_process(arith_dir, tmp_path):
    overrides = arith_overrides(arith_dir, tmp_path, "train.max_steps=1000")
    env = dict(env_one_thread(), NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    code, out = sigterm_after_step([str(REPO / "launch" / "colocate.sh"), str(CONFIG), *overrides], env, step=2,
                                   wait_s=180, new_session=True)
    assert code != 0
    assert "stopped by SIGTERM on rank 0; sockets closed" in out
    assert "stopped by SIGTERM on rank 1; sockets closed" in out
    # No orphan: nothing is left running with this run's output folder on its command line.
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert left == [], f"orphan processes {left}"


def test_a_run_whose_imports_compile_from_source_says_so_once(arith_dir, tmp_path):
    """PYTHONDONTWRITEBYTECODE=1 with no byte code where Python looks (here: an empty PYTHONPYCACHEPREFIX, as an
    install without .pyc files): every process compiles torch and transformers at its start, which the run says once
    with the command that fixes it (streamrft/bytecode.py), and it still trains."""
    env = dict(env_one_thread(), PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(tmp_path / "no_pyc"))
    proc = subprocess.run([sys.executable, "-m", "streamrft.cli", "train", str(CONFIG),
                           *arith_overrides(arith_dir, tmp_path / "out")],
                          env=env, timeout=300, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.count("compiled from source at import") == 1, proc.stderr[-3000:]
    assert "torch" in proc.stderr.split("compiled from source at import")[0].splitlines()[-1]
    assert "python -m compileall -q " in proc.stderr
    assert len(steps_of(tmp_path / "out")) == 1
    assert not (tmp_path / "no_pyc").exists()  # nothing was written: the setting held
