from __future__ import annotations

from streamrft.config.base import Section


class AlgorithmConfig(Section):
    advantage_estimator: str = "group_norm"  # name in streamrft.algorithms.ADVANTAGE_ESTIMATORS
    policy_loss: str = "ppo_clip"  # name in streamrft.algorithms.POLICY_LOSSES
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    clip_eps_low: float = 0.2  # PPO ratio clip below 1
    clip_eps_high: float = 0.2  # PPO ratio clip above 1 (DAPO clip-higher: e.g. 0.28)
    dual_clip_c: float = 3.0  # dual-clip bound for negative advantages (> 1)
    norm_eps: float = 1e-6  # epsilon in group std normalisation
    kl_coef: float = 0.0  # 0 = no reference model
    kl_estimator: str = "k3"  # k1 | k2 | k3
    kl_mode: str = "loss"  # loss | reward
    entropy_coef: float = 0.0
    tis_mode: str = "token"  # truncated importance sampling with behaviour log-probs: token | sequence | off
    tis_cap: float = 2.0  # truncation of the behaviour importance weight
