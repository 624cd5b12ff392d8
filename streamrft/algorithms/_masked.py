"""Masked reductions shared by the estimators: group statistics, last response token, discounted sums.

Every function here is exact on ragged batches: positions where ``mask_BT`` is 0 never change a result.
"""

from __future__ import annotations

import torch
from torch import Tensor


def identity(x: Tensor) -> Tensor:
    """The single-rank ``all_reduce_sum``: the local sum is already the global sum."""
    return x


def group_stats(rewards_B: Tensor, group_index_B: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (mean, unbiased std, count) of the sample's own group, float64.

    Groups are the distinct values of ``group_index_B`` wherever they sit in the batch (interleaved
    groups are fine). std uses Bessel's correction, sqrt(sum (r - mean)^2 / (n - 1)); a group of one
    sample has std 0 by definition here (its centred reward is 0 anyway).
    """
    assert rewards_B.dim() == 1 and rewards_B.shape == group_index_B.shape, "rewards and group_index must be (B,)"
    # float64, two-pass (mean, then squared deviations): float32 rewards with a large common offset keep
    # their spread. The results are float64; estimators cast once at the end.
    r64_B = rewards_B.to(torch.float64)
    _, inv_B = torch.unique(group_index_B, return_inverse=True)
    n_groups = int(inv_B.max().item()) + 1 if inv_B.numel() else 0
    zeros_G = r64_B.new_zeros(n_groups)
    count_G = zeros_G.index_add(0, inv_B, torch.ones_like(r64_B))
    mean_G = zeros_G.index_add(0, inv_B, r64_B) / count_G
    dev_B = r64_B - mean_G[inv_B]
    ss_G = zeros_G.index_add(0, inv_B, dev_B * dev_B)
    var_G = torch.where(count_G > 1, ss_G / (count_G - 1).clamp(min=1), torch.zeros_like(ss_G))
    return mean_G[inv_B], var_G.sqrt()[inv_B], count_G[inv_B]


def last_token_onehot(mask_BT: Tensor) -> Tensor:
    """(B, T) one-hot at each row's last response token (all zero for an empty row)."""
    pos_T = torch.arange(mask_BT.shape[1], device=mask_BT.device)
    last_B = torch.where(mask_BT > 0, pos_T, torch.full_like(pos_T, -1)).amax(dim=1)  # (B,)
    return (pos_T[None, :] == last_B[:, None]).to(mask_BT.dtype)


def token_level_rewards(rewards_B: Tensor, mask_BT: Tensor, token_rewards_BT: Tensor | None) -> Tensor:
    """r_t = token_rewards_t (masked) + the sequence reward at the last response token.  (B, T)"""
    r_BT = last_token_onehot(mask_BT).to(rewards_B.dtype) * rewards_B[:, None]
    if token_rewards_BT is not None:
        r_BT = r_BT + torch.where(mask_BT > 0, token_rewards_BT.to(r_BT.dtype), torch.zeros_like(r_BT))
    return r_BT


def discounted_returns(r_BT: Tensor, gamma: float) -> Tensor:
    """G_t = sum_{k >= t} gamma^(k - t) r_k, by the backward recursion G_t = r_t + gamma G_{t+1}.  (B, T)"""
    out_BT = torch.zeros_like(r_BT)
    running_B = torch.zeros_like(r_BT[:, 0])
    for t in range(r_BT.shape[1] - 1, -1, -1):
        running_B = r_BT[:, t] + gamma * running_B
        out_BT[:, t] = running_B
    return out_BT


def masked_global_mean_std(x_BT: Tensor, mask_BT: Tensor, all_reduce_sum) -> tuple[Tensor, Tensor]:
    """Mean and unbiased std (float64 scalars) of x over masked tokens of the whole step batch (all ranks).

    Two passes in float64, two all-reduces: [n, sum x] gives mu; then sum (x - mu)^2 gives
    var = ss / (n - 1), 0 when n <= 1. One pass, var = (S2 - S1^2 / n) / (n - 1), cancels
    catastrophically when |mu| >> sigma (rewards 1 +- 3e-4 in float32 gave std 333x too large); the
    shifted sum is exact to float64 rounding. Callers keep mu and sigma in float64 until the division.
    """
    keep_BT = mask_BT > 0
    x64_BT = torch.where(keep_BT, x_BT.to(torch.float64), torch.zeros((), dtype=torch.float64, device=x_BT.device))
    n, s1 = all_reduce_sum(torch.stack([keep_BT.sum().to(torch.float64), x64_BT.sum()])).unbind(0)
    mean = s1 / n.clamp(min=1)
    dev_BT = torch.where(keep_BT, x64_BT - mean, torch.zeros_like(x64_BT))
    (ss,) = all_reduce_sum((dev_BT * dev_BT).sum().reshape(1)).unbind(0)
    var = torch.where(n > 1, ss / (n - 1).clamp(min=1), torch.zeros_like(ss))
    return mean, var.sqrt()


def standardise(x_BT: Tensor, mean: Tensor, std: Tensor, eps: float, shift_mean: bool = True) -> Tensor:
    """(x - mu) / (sigma + eps) (or x / (sigma + eps)) computed in float64, returned in x's dtype: the
    difference of two nearby float32 numbers would otherwise lose the digits whitening is about."""
    x64_BT = x_BT.to(torch.float64)
    out_BT = (x64_BT - mean) if shift_mean else x64_BT
    return (out_BT / (std + eps)).to(x_BT.dtype)


def mask_out(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """x where mask is set, exactly 0 elsewhere (also where x is nan or inf)."""
    return torch.where(mask_BT > 0, x_BT, torch.zeros_like(x_BT))


def pad_rows(rows: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Ragged per-sample vectors -> (values_BT, mask_BT), right-padded with zeros (float32).

    T is the longest row (at least 1), so an all-empty batch still has a valid (B, 1) shape."""
    T = max((len(r) for r in rows), default=0) or 1
    values_BT = torch.zeros(len(rows), T, dtype=torch.float32)
    mask_BT = torch.zeros(len(rows), T, dtype=torch.float32)
    for i, r in enumerate(rows):
        values_BT[i, : len(r)] = r
        mask_BT[i, : len(r)] = 1.0
    return values_BT, mask_BT
