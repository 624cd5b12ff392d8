"""validate_algorithm: raise ConfigError for algorithm settings that cannot run; never fills values in."""

from __future__ import annotations

from streamrft.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES
from streamrft.algorithms.offpolicy import OFFPOLICY_MASKS, TIS_WEIGHTS
from streamrft.config.base import ConfigError

# Estimators that read AdvantageInputs.token_rewards (so kl_mode=reward reaches the advantages).
TOKEN_REWARD_ESTIMATORS = ("reinforce", "reinforce++", "reinforce_baseline", "gae")


def _choose(key: str, value: str, valid) -> None:
    if value not in valid:
        raise ConfigError(f"algorithm.{key}={value!r} is unknown; choose one of: {', '.join(sorted(valid))}")


def _names(cfg) -> None:
    a = cfg.algorithm
    _choose("advantage_estimator", a.advantage_estimator, ADVANTAGE_ESTIMATORS)
    _choose("policy_loss", a.policy_loss, POLICY_LOSSES)
    _choose("loss_agg_mode", a.loss_agg_mode, LOSS_AGG_MODES)
    _choose("kl_estimator", a.kl_estimator, KL_ESTIMATORS)
    _choose("kl_mode", a.kl_mode, ("loss", "reward"))
    _choose("kl_ctl_type", a.kl_ctl_type, ("fixed", "adaptive"))
    _choose("tis_mode", a.tis_mode, TIS_WEIGHTS)
    _choose("offpolicy_mask", a.offpolicy_mask, OFFPOLICY_MASKS)


def _ranges(cfg) -> None:
    a = cfg.algorithm
    if not 0 <= a.clip_eps_low < 1:
        raise ConfigError(f"algorithm.clip_eps_low={a.clip_eps_low} must be in [0, 1) (the ratio floor is 1 - clip_eps_low)")
    if a.clip_eps_high < 0:
        raise ConfigError(f"algorithm.clip_eps_high={a.clip_eps_high} must be >= 0")
    if a.dual_clip_c <= 1:
        raise ConfigError(f"algorithm.dual_clip_c={a.dual_clip_c} must be > 1 (it bounds -A * ratio for A < 0)")
    if a.tis_cap < 1:
        raise ConfigError(f"algorithm.tis_cap={a.tis_cap} must be >= 1; use algorithm.tis_mode=off to disable truncated IS")
    if not 0 <= a.offpolicy_mask_low < 1:
        raise ConfigError(
            f"algorithm.offpolicy_mask_low={a.offpolicy_mask_low} must be in [0, 1) (a ratio of 1, on-policy, must be kept)"
        )
    if a.offpolicy_mask_high <= 1:
        raise ConfigError(
            f"algorithm.offpolicy_mask_high={a.offpolicy_mask_high} must be > 1 (a ratio of 1, on-policy, must be kept)"
        )
    if not 0 < a.high_entropy_ratio <= 1:
        raise ConfigError(f"algorithm.high_entropy_ratio={a.high_entropy_ratio} must be in (0, 1] (1.0 = train on all tokens)")
    if not 0 <= a.gamma <= 1:
        raise ConfigError(f"algorithm.gamma={a.gamma} must be in [0, 1]")
    if not 0 <= a.lam <= 1:
        raise ConfigError(f"algorithm.lam={a.lam} must be in [0, 1]")
    if a.norm_eps <= 0:
        raise ConfigError(f"algorithm.norm_eps={a.norm_eps} must be > 0")
    if a.gmpo_clip_eps <= 0:
        raise ConfigError(f"algorithm.gmpo_clip_eps={a.gmpo_clip_eps} must be > 0")
    for key in ("kl_coef", "entropy_coef", "cpg_drift_coef", "advantage_clip", "reward_clip", "value_clip_eps",
                "overlong_penalty_factor", "kl_adaptive_error_clip"):
        if getattr(a, key) < 0:
            raise ConfigError(f"algorithm.{key}={getattr(a, key)} must be >= 0")
    if a.max_extra_prompts < 0:
        raise ConfigError(f"algorithm.max_extra_prompts={a.max_extra_prompts} must be >= 0")
    if a.kl_ctl_type == "adaptive" and (a.kl_target <= 0 or a.kl_horizon < 1):
        raise ConfigError(
            f"algorithm.kl_ctl_type=adaptive needs algorithm.kl_target > 0 and algorithm.kl_horizon >= 1, "
            f"got kl_target={a.kl_target}, kl_horizon={a.kl_horizon}"
        )
    max_new = cfg.engine.max_new_tokens
    if not 0 <= a.overlong_buffer_len < max_new:
        raise ConfigError(
            f"algorithm.overlong_buffer_len={a.overlong_buffer_len} must be in [0, engine.max_new_tokens={max_new})"
        )


def _combinations(cfg) -> None:
    a = cfg.algorithm
    est = ADVANTAGE_ESTIMATORS[a.advantage_estimator]
    n = cfg.rollout.n_samples_per_prompt
    if est.scope == "group" and n < 2:
        raise ConfigError(
            f"algorithm.advantage_estimator={a.advantage_estimator} needs rollout.n_samples_per_prompt >= 2, got {n}"
        )
    if a.dynamic_sampling and n < 2:
        raise ConfigError(
            f"algorithm.dynamic_sampling=true needs rollout.n_samples_per_prompt >= 2, got {n} "
            "(every group of one sample has zero variance)"
        )
    if a.advantage_estimator == "dr_grpo" and a.loss_agg_mode != "seq-mean-token-sum-norm":
        raise ConfigError(
            f"algorithm.advantage_estimator=dr_grpo needs algorithm.loss_agg_mode=seq-mean-token-sum-norm, "
            f"got {a.loss_agg_mode} (any other mode brings back the length bias Dr. GRPO removes)"
        )
    if a.policy_loss == "clip_higher" and a.clip_eps_high <= a.clip_eps_low:
        raise ConfigError(
            f"algorithm.policy_loss=clip_higher needs algorithm.clip_eps_high > algorithm.clip_eps_low, got "
            f"{a.clip_eps_high} <= {a.clip_eps_low}; set clip_eps_high (DAPO uses 0.28) or use policy_loss=ppo_clip"
        )
    if a.whiten_advantages and est.scope == "group":
        raise ConfigError(
            f"algorithm.whiten_advantages=true needs a batch-scope estimator, but "
            f"algorithm.advantage_estimator={a.advantage_estimator} is group-scope; use reinforce, reinforce++ or gae"
        )
    if a.reward_running_norm and est.scope == "group":
        raise ConfigError(
            f"algorithm.reward_running_norm=true needs a batch-scope estimator (its statistics are synchronised "
            f"across ranks at train time), but algorithm.advantage_estimator={a.advantage_estimator} is group-scope; "
            "use reinforce, reinforce++ or gae"
        )
    if a.kl_mode == "reward" and a.kl_coef > 0 and a.advantage_estimator not in TOKEN_REWARD_ESTIMATORS:
        raise ConfigError(
            f"algorithm.kl_mode=reward would drop the KL: algorithm.advantage_estimator={a.advantage_estimator} "
            f"ignores token rewards; set algorithm.kl_mode=loss or use one of: {', '.join(TOKEN_REWARD_ESTIMATORS)}"
        )
    # The config tree has no critic section yet; model.critic_path is where it is expected to appear.
    critic_path = getattr(cfg.model, "critic_path", "")
    if est.needs_critic and not critic_path:
        raise ConfigError(
            f"algorithm.advantage_estimator={a.advantage_estimator} needs a critic; set model.critic_path "
            "(a model directory for the value model)"
        )


def validate_algorithm(cfg) -> None:
    """Check cfg.algorithm against itself, cfg.rollout.n_samples_per_prompt and cfg.engine.max_new_tokens."""
    _names(cfg)
    _ranges(cfg)
    _combinations(cfg)
