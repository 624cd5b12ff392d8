"""Every row of the algorithm matrix runs end to end on the arith pipeline with no NaN, and the
metrics it should move are reported (steps.jsonl holds the reduced per-step metrics)."""

from __future__ import annotations

import json
import math

import pytest

from streamrft.config import load_config
from tests.integration.conftest import REPO, arith_overrides

# one busy process at a time (pytest's, or one subprocess it waits on): `make test` runs it in the unit group
# (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.one_process]
CONFIG = REPO / "pipelines" / "arith" / "config.yaml"


def run(arith_dir, out, *extra):
    from streamrft.compose import train

    summary = train(load_config(CONFIG, arith_overrides(arith_dir, out, "train.max_steps=3", "data.eval_path=", *extra)))
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    for step in steps:
        for key, value in step.items():
            assert math.isfinite(value), f"{key}={value} at step {step['step']}"
    return summary, steps


ROWS = {
    "group_norm": [],
    "dr_grpo": ["algorithm.loss_agg_mode=seq-mean-token-sum-norm"],
    "rloo": [],
    "reinforce_baseline": [],
    "cpgd": ["algorithm.policy_loss=cpg"],
    "reinforce": [],
    "reinforce++": ["algorithm.kl_coef=0.01", "algorithm.kl_mode=reward", "algorithm.whiten_advantages=true"],
    "gae": ["algorithm.lam=0.95", "MODEL_AS_CRITIC"],
}


@pytest.mark.parametrize("estimator", sorted(ROWS))
def test_every_advantage_estimator_trains_without_nan(arith_dir, tmp_path, estimator):
    extra = [e for e in ROWS[estimator] if e != "MODEL_AS_CRITIC"]
    if "MODEL_AS_CRITIC" in ROWS[estimator]:
        extra.append(f"model.critic_path={arith_dir / 'sft'}")
    _, steps = run(arith_dir, tmp_path, f"algorithm.advantage_estimator={estimator}", *extra)
    assert len(steps) == 3
    if estimator == "gae":
        assert all("value_loss" in s for s in steps)


@pytest.mark.parametrize(
    "loss,extra",
    [
        ("ppo_clip", []),
        ("clip_higher", ["algorithm.clip_eps_high=0.28"]),
        ("dual_clip", []),
        ("gspo", ["algorithm.loss_agg_mode=seq-mean-token-mean", "algorithm.tis_mode=sequence"]),
        ("gmpo", ["algorithm.loss_agg_mode=seq-mean-token-mean"]),
        ("cpg", []),
    ],
)
def test_every_policy_loss_reports_clip_and_ratio_statistics(arith_dir, tmp_path, loss, extra):
    _, steps = run(arith_dir, tmp_path, f"algorithm.policy_loss={loss}", "train.ppo_epochs=2", *extra)
    last = steps[-1]
    for key in ("clip_fraction", "ratio_mean", "tis_clipped_fraction", "entropy", "grad_norm", "lr"):
        assert key in last, key
    # Two passes over the same samples: the second pass sees a moved policy.
    assert any(s["ratio_mean"] != 1.0 for s in steps)


def test_kl_loss_with_adaptive_coefficient_moves_kl_and_the_coefficient(arith_dir, tmp_path):
    _, steps = run(arith_dir, tmp_path, "algorithm.kl_coef=0.1", "algorithm.kl_estimator=k2", "algorithm.kl_ctl_type=adaptive",
                   "algorithm.kl_target=0.0001", "algorithm.kl_horizon=100", "train.lr=3e-3")
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert steps[-1]["kl"] > 0
    assert steps[-1]["kl_coef"] != steps[0]["kl_coef"]


def test_dynamic_sampling_refills_filtered_groups_and_counts_them(arith_dir, tmp_path):
    summary, _ = run(arith_dir, tmp_path, "algorithm.dynamic_sampling=true", "algorithm.max_extra_prompts=64")
    assert summary["refilled_prompts"] > 0
    assert summary.get("samples_filtered/zero_variance", 0) > 0
    assert summary["samples_admitted"] == summary["samples_trained"] + sum(
        v for k, v in summary.items() if k.startswith("samples_filtered/") or k.startswith("samples_failed/")
    )


def test_high_entropy_ratio_trains_on_that_fraction_of_tokens(arith_dir, tmp_path):
    _, steps = run(arith_dir, tmp_path, "algorithm.high_entropy_ratio=0.25")
    for step in steps:
        assert 0.15 <= step["tokens_kept_fraction"] <= 0.45


def test_overlong_shaping_fire_sampling_entropy_bonus_and_reward_clip_run_together(arith_dir, tmp_path):
    _, steps = run(arith_dir, tmp_path, "engine.max_new_tokens=4", "algorithm.overlong_buffer_len=2", "algorithm.overlong_filter=true",
                   "engine.first_token_temperature=1.5", "algorithm.entropy_coef=0.01", "algorithm.reward_clip=0.5")
    assert all(s["reward_mean"] <= 0.5 for s in steps)
