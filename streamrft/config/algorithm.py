from __future__ import annotations

from streamrft.config.base import Section


class AlgorithmConfig(Section):
    # --- advantage estimation (streamrft/algorithms/advantages_*.py) ---
    advantage_estimator: str = "group_norm"  # name in streamrft.algorithms.ADVANTAGE_ESTIMATORS
    norm_eps: float = 1e-6  # epsilon added to a std before dividing (group_norm, reinforce++, whitening, reward norm)
    gamma: float = 1.0  # discount over response tokens (reinforce, reinforce_baseline, reinforce++, gae)
    lam: float = 1.0  # GAE lambda (gae only)
    whiten_advantages: bool = False  # batch-scope estimators only: whiten advantages over the global batch
    advantage_clip: float = 0.0  # clip advantages to [-advantage_clip, advantage_clip]; 0 = off
    # --- policy loss (streamrft/algorithms/policy_losses.py) ---
    policy_loss: str = "ppo_clip"  # name in streamrft.algorithms.POLICY_LOSSES
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    clip_eps_low: float = 0.2  # PPO ratio clip below 1, in [0, 1)
    clip_eps_high: float = 0.2  # PPO ratio clip above 1 (DAPO clip-higher: e.g. 0.28)
    dual_clip_c: float = 3.0  # dual-clip bound for negative advantages (> 1)
    gmpo_clip_eps: float = 0.4  # GMPO: token log-ratio clip range [-eps, eps] (the paper's e^{+-0.4})
    cpg_drift_coef: float = 0.1  # CPGD: weight of the policy-drift term KL(pi_old || pi) in the cpg loss
    # --- off-policy correction, behaviour (engine) vs proximal (learner at step start) policy
    #     (streamrft/algorithms/offpolicy.py); the two families compose: weight = tis * mask ---
    tis_mode: str = "token"  # truncated IS weight min(pi_prox / pi_beh, tis_cap) (decoupled PPO): token | sequence | off
    tis_cap: float = 2.0  # truncation of the behaviour importance weight (>= 1)
    offpolicy_mask: str = "off"  # drop tokens (token) or whole sequences (sequence, geometric-mean ratio) whose pi_prox / pi_beh leaves [low, high] (IcePop / MIS): token | sequence | off
    offpolicy_mask_low: float = 0.5  # lower bound of the kept ratio window, in [0, 1) (0 = no lower bound, MIS)
    offpolicy_mask_high: float = 5.0  # upper bound of the kept ratio window, > 1
    entropy_coef: float = 0.0  # entropy bonus weight (learner: loss - entropy_coef * entropy)
    # --- KL to the reference policy (streamrft/algorithms/kl.py) ---
    kl_coef: float = 0.0  # initial KL coefficient; 0 = no reference model
    kl_estimator: str = "k3"  # k1 | k2 | k3 (Schulman's estimators of KL(pi || ref))
    kl_mode: str = "loss"  # loss (added to the policy loss) | reward (folded into token_rewards)
    kl_ctl_type: str = "fixed"  # fixed | adaptive (Ziegler et al. 1909.08593)
    kl_target: float = 6.0  # adaptive KL controller: target KL per sequence
    kl_horizon: int = 10000  # adaptive KL controller: horizon in samples
    kl_adaptive_error_clip: float = 0.2  # adaptive KL controller: clip of the proportional error (current/target - 1)
    # --- filters and shaping (streamrft/algorithms/filters.py, normalize.py) ---
    dynamic_sampling: bool = False  # DAPO: drop prompt groups whose rewards are all equal and refill the batch
    max_extra_prompts: int = 0  # DAPO refill: most extra prompt groups admitted per step beyond prompts_per_step
    overlong_buffer_len: int = 0  # DAPO soft overlong punishment window before engine.max_new_tokens; 0 = off
    overlong_penalty_factor: float = 1.0  # DAPO soft overlong punishment: penalty at the length cap
    overlong_filter: bool = False  # mask out truncated samples (finish_reason="length") from the loss
    high_entropy_ratio: float = 1.0  # 2506.01939: train on the top fraction of tokens by entropy; 1.0 = all
    reward_clip: float = 0.0  # clip sequence rewards to [-reward_clip, reward_clip]; 0 = off
    reward_running_norm: bool = False  # normalise rewards by running mean/std synchronised across ranks
    value_clip_eps: float = 0.2  # clipped value loss range around the old values (gae)
