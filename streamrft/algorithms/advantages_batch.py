"""Batch-scope advantage estimators (need the whole step batch, or a critic) and the clipped value loss.

Token rewards: r_t = token_rewards_t + r * [t = last response token] (see _masked.token_level_rewards).
Discounting runs over positions; positions outside the mask carry no reward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from streamrft.algorithms._masked import (
    discounted_returns,
    identity,
    mask_out,
    masked_global_mean_std,
    standardise,
    token_level_rewards,
)
from streamrft.algorithms.advantage_types import AdvantageInputs, AdvantageOutputs, finish
from streamrft.algorithms.normalize import whiten_advantages
from streamrft.config.algorithm import AlgorithmConfig


def _maybe_whiten(adv_BT: Tensor, inp: AdvantageInputs, cfg: AlgorithmConfig, all_reduce_sum) -> Tensor:
    if cfg.whiten_advantages:
        return whiten_advantages(adv_BT, inp.response_mask, all_reduce_sum, eps=cfg.norm_eps)
    return adv_BT


def reinforce(inp: AdvantageInputs, cfg: AlgorithmConfig, all_reduce_sum=identity) -> AdvantageOutputs:
    """REINFORCE (Williams 1992) without a baseline: A_t = G_t = sum_{k >= t} gamma^(k-t) r_k.

    algorithm.whiten_advantages=true whitens A over the global batch.
    """
    r_BT = token_level_rewards(inp.rewards, inp.response_mask, inp.token_rewards)
    returns_BT = mask_out(discounted_returns(r_BT, cfg.gamma), inp.response_mask)
    adv_BT = _maybe_whiten(returns_BT, inp, cfg, all_reduce_sum)
    return AdvantageOutputs(finish(adv_BT, inp.response_mask, cfg), returns_BT)


def reinforce_plus_plus(inp: AdvantageInputs, cfg: AlgorithmConfig, all_reduce_sum=identity) -> AdvantageOutputs:
    """REINFORCE++ (Hu, arXiv:2501.03262): token-level KL folded into rewards, then

    A_t = (G_t - mu) / (sigma + eps), mu and unbiased sigma over every masked token of the global
    step batch (one all_reduce_sum). The caller puts -kl_coef * kl_t into ``token_rewards``
    (algorithm.kl_mode=reward). Left out: the paper's reward clipping (see algorithm.reward_clip).
    """
    r_BT = token_level_rewards(inp.rewards, inp.response_mask, inp.token_rewards)
    returns_BT = mask_out(discounted_returns(r_BT, cfg.gamma), inp.response_mask)
    mean, std = masked_global_mean_std(returns_BT, inp.response_mask, all_reduce_sum)  # float64, two-pass
    adv_BT = standardise(returns_BT, mean, std, cfg.norm_eps)
    return AdvantageOutputs(finish(adv_BT, inp.response_mask, cfg), returns_BT)


def gae(inp: AdvantageInputs, cfg: AlgorithmConfig, all_reduce_sum=identity) -> AdvantageOutputs:
    """GAE (Schulman et al., arXiv:1506.02438):

    delta_t = r_t + gamma V_{t+1} - V_t  (V beyond the last response token is 0),
    A_t = delta_t + gamma lam A_{t+1},  returns_t = A_t + V_t (the value target).
    algorithm.whiten_advantages=true whitens A (not the returns) over the global batch.
    """
    if inp.values is None:
        raise ValueError("advantage_estimator=gae needs critic values (AdvantageInputs.values is None)")
    mask_BT = inp.response_mask
    r_BT = token_level_rewards(inp.rewards, mask_BT, inp.token_rewards)
    v_BT = mask_out(inp.values.to(r_BT.dtype), mask_BT)
    adv_BT = torch.zeros_like(r_BT)
    next_v_B = torch.zeros_like(r_BT[:, 0])
    next_a_B = torch.zeros_like(r_BT[:, 0])
    for t in range(r_BT.shape[1] - 1, -1, -1):
        delta_B = r_BT[:, t] + cfg.gamma * next_v_B - v_BT[:, t]
        next_a_B = delta_B + cfg.gamma * cfg.lam * next_a_B
        adv_BT[:, t] = next_a_B
        next_v_B = v_BT[:, t]
    adv_BT = mask_out(adv_BT, mask_BT)
    returns_BT = mask_out(adv_BT + v_BT, mask_BT)
    adv_BT = _maybe_whiten(adv_BT, inp, cfg, all_reduce_sum)
    return AdvantageOutputs(finish(adv_BT, mask_BT, cfg), returns_BT)


def value_loss(
    values_BT: Tensor, old_values_BT: Tensor, returns_BT: Tensor, mask_BT: Tensor, clip_eps: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped value loss, per token (aggregate with aggregate_loss):

    L_t = 0.5 max((V_t - R_t)^2, (V_old + clip(V_t - V_old, -eps, eps) - R_t)^2); clip_eps <= 0 = no clip.
    Returns (loss_BT, {"vf_clipped": (B, T) 0/1 where the clipped branch is the larger}).
    """
    unclipped_BT = (values_BT - returns_BT) ** 2
    if clip_eps <= 0:
        return mask_out(0.5 * unclipped_BT, mask_BT), {"vf_clipped": torch.zeros_like(unclipped_BT)}
    v_clip_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip_eps, clip_eps)
    clipped_BT = (v_clip_BT - returns_BT) ** 2
    loss_BT = 0.5 * torch.maximum(unclipped_BT, clipped_BT)
    vf_clipped_BT = mask_out((clipped_BT > unclipped_BT).to(values_BT.dtype), mask_BT).detach()
    return mask_out(loss_BT, mask_BT), {"vf_clipped": vf_clipped_BT}
