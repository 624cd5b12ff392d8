"""validate_algorithm: every rejected setting, with its exact message."""

from __future__ import annotations

import re

import pytest

from streamrft.algorithms.validate import validate_algorithm
from streamrft.config import Config, ConfigError
from streamrft.config.algorithm import AlgorithmConfig
from streamrft.config.engine import EngineConfig
from streamrft.config.rollout import RolloutConfig


def cfg_with(n_samples: int = 8, max_new_tokens: int = 32, **algo) -> Config:
    return Config(
        algorithm=AlgorithmConfig(**algo),
        rollout=RolloutConfig(n_samples_per_prompt=n_samples),
        engine=EngineConfig(max_new_tokens=max_new_tokens),
    )


def test_the_default_config_and_the_main_recipes_are_valid():
    validate_algorithm(cfg_with())
    validate_algorithm(cfg_with(advantage_estimator="dr_grpo", loss_agg_mode="seq-mean-token-sum-norm"))
    validate_algorithm(cfg_with(policy_loss="clip_higher", clip_eps_high=0.28, dynamic_sampling=True,
                                max_extra_prompts=16, overlong_buffer_len=8))
    validate_algorithm(cfg_with(n_samples=1, advantage_estimator="reinforce++", kl_mode="reward", kl_coef=0.01))
    validate_algorithm(cfg_with(advantage_estimator="cpgd", policy_loss="cpg", high_entropy_ratio=0.2))


CASES = [
    (dict(advantage_estimator="grpo"),
     "algorithm.advantage_estimator='grpo' is unknown; choose one of: cpgd, dr_grpo, gae, group_norm, reinforce, "
     "reinforce++, reinforce_baseline, rloo"),
    (dict(policy_loss="ppo"),
     "algorithm.policy_loss='ppo' is unknown; choose one of: clip_higher, cpg, dual_clip, gmpo, gspo, ppo_clip"),
    (dict(loss_agg_mode="mean"),
     "algorithm.loss_agg_mode='mean' is unknown; choose one of: seq-mean-token-mean, seq-mean-token-sum, "
     "seq-mean-token-sum-norm, token-mean"),
    (dict(kl_estimator="k4"), "algorithm.kl_estimator='k4' is unknown; choose one of: k1, k2, k3"),
    (dict(kl_mode="both"), "algorithm.kl_mode='both' is unknown; choose one of: loss, reward"),
    (dict(kl_ctl_type="pid"), "algorithm.kl_ctl_type='pid' is unknown; choose one of: adaptive, fixed"),
    (dict(tis_mode="always"), "algorithm.tis_mode='always' is unknown; choose one of: off, sequence, token"),
    (dict(clip_eps_low=1.0), "algorithm.clip_eps_low=1.0 must be in [0, 1) (the ratio floor is 1 - clip_eps_low)"),
    (dict(clip_eps_high=-0.1), "algorithm.clip_eps_high=-0.1 must be >= 0"),
    (dict(dual_clip_c=1.0), "algorithm.dual_clip_c=1.0 must be > 1 (it bounds -A * ratio for A < 0)"),
    (dict(tis_cap=0.5), "algorithm.tis_cap=0.5 must be >= 1; use algorithm.tis_mode=off to disable truncated IS"),
    (dict(high_entropy_ratio=0.0), "algorithm.high_entropy_ratio=0.0 must be in (0, 1] (1.0 = train on all tokens)"),
    (dict(high_entropy_ratio=1.5), "algorithm.high_entropy_ratio=1.5 must be in (0, 1] (1.0 = train on all tokens)"),
    (dict(gamma=1.1), "algorithm.gamma=1.1 must be in [0, 1]"),
    (dict(lam=-0.1), "algorithm.lam=-0.1 must be in [0, 1]"),
    (dict(norm_eps=0.0), "algorithm.norm_eps=0.0 must be > 0"),
    (dict(gmpo_clip_eps=0.0), "algorithm.gmpo_clip_eps=0.0 must be > 0"),
    (dict(kl_coef=-0.01), "algorithm.kl_coef=-0.01 must be >= 0"),
    (dict(max_extra_prompts=-1), "algorithm.max_extra_prompts=-1 must be >= 0"),
    (dict(kl_ctl_type="adaptive", kl_target=0.0),
     "algorithm.kl_ctl_type=adaptive needs algorithm.kl_target > 0 and algorithm.kl_horizon >= 1, "
     "got kl_target=0.0, kl_horizon=10000"),
    (dict(overlong_buffer_len=32), "algorithm.overlong_buffer_len=32 must be in [0, engine.max_new_tokens=32)"),
    (dict(n_samples=1), "algorithm.advantage_estimator=group_norm needs rollout.n_samples_per_prompt >= 2, got 1"),
    (dict(n_samples=1, advantage_estimator="reinforce", dynamic_sampling=True),
     "algorithm.dynamic_sampling=true needs rollout.n_samples_per_prompt >= 2, got 1 "
     "(every group of one sample has zero variance)"),
    (dict(advantage_estimator="dr_grpo"),
     "algorithm.advantage_estimator=dr_grpo needs algorithm.loss_agg_mode=seq-mean-token-sum-norm, got token-mean "
     "(any other mode brings back the length bias Dr. GRPO removes)"),
    (dict(policy_loss="clip_higher"),
     "algorithm.policy_loss=clip_higher needs algorithm.clip_eps_high > algorithm.clip_eps_low, got 0.2 <= 0.2; "
     "set clip_eps_high (DAPO uses 0.28) or use policy_loss=ppo_clip"),
    (dict(whiten_advantages=True),
     "algorithm.whiten_advantages=true needs a batch-scope estimator, but algorithm.advantage_estimator=group_norm "
     "is group-scope; use reinforce, reinforce++ or gae"),
    (dict(kl_mode="reward", kl_coef=0.01),
     "algorithm.kl_mode=reward would drop the KL: algorithm.advantage_estimator=group_norm ignores token rewards; "
     "set algorithm.kl_mode=loss or use one of: reinforce, reinforce++, reinforce_baseline, gae"),
    (dict(advantage_estimator="gae"),
     "algorithm.advantage_estimator=gae needs a critic; set model.critic_path (a model directory for the value model)"),
]


@pytest.mark.parametrize("settings,message", CASES, ids=[m.split(" ")[0] + str(i) for i, (_, m) in enumerate(CASES)])
def test_each_invalid_setting_is_rejected_with_its_exact_message(settings, message):
    settings = dict(settings)
    n_samples = settings.pop("n_samples", 8)
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        validate_algorithm(cfg_with(n_samples=n_samples, **settings))
