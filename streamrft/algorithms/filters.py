"""Sample and token filters and reward shaping (pure functions; the refill loop lives in the Generator)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def zero_variance_groups(rewards_B: Tensor, group_index_B: Tensor) -> Tensor:
    """DAPO dynamic sampling (Yu et al., arXiv:2503.14476): (B,) bool, True for every sample of a group
    whose rewards are all exactly equal (max == min), so its group-relative advantage is 0 everywhere.

    The Generator drops these groups and admits more prompts, at most algorithm.max_extra_prompts.
    """
    _, inv_B = torch.unique(group_index_B, return_inverse=True)
    n_groups = int(inv_B.max().item()) + 1 if inv_B.numel() else 0
    r = rewards_B.to(torch.float64)
    max_G = torch.full((n_groups,), -math.inf, dtype=r.dtype).scatter_reduce(0, inv_B, r, "amax")
    min_G = torch.full((n_groups,), math.inf, dtype=r.dtype).scatter_reduce(0, inv_B, r, "amin")
    return (max_G == min_G)[inv_B]


def overlong_penalty(response_len: Tensor, max_len: int, buffer_len: int, penalty_factor: float) -> Tensor:
    """DAPO soft overlong punishment (arXiv:2503.14476, eq. 13), added to the sequence reward:

        0                                       if L <= L_max - L_buf
        ((L_max - L_buf) - L) / L_buf * factor   if L_max - L_buf < L <= L_max
        -factor                                 if L > L_max
    with L_max = engine.max_new_tokens, L_buf = algorithm.overlong_buffer_len (0 = off: all zeros),
    factor = algorithm.overlong_penalty_factor.
    """
    L = response_len.to(torch.float64)
    if buffer_len <= 0:
        return torch.zeros_like(L)
    start = float(max_len - buffer_len)
    ramp = (start - L) / buffer_len * penalty_factor
    out = torch.where(L <= start, torch.zeros_like(L), ramp)
    return torch.where(L > max_len, torch.full_like(L, -penalty_factor), out)


def overlong_filter(response_mask_BT: Tensor, truncated_B: Tensor) -> Tensor:
    """DAPO overlong filtering: zero the loss mask of truncated samples (finish_reason == "length").

    (B, T) mask; enabled by algorithm.overlong_filter. The samples still count as trained for the
    accounting but contribute no gradient.
    """
    return response_mask_BT * (~truncated_B.bool()).to(response_mask_BT.dtype)[:, None]


def high_entropy_token_mask(entropy_BT: Tensor, mask_BT: Tensor, top_fraction: float) -> Tensor:
    """Forking-token training (Wang et al., arXiv:2506.01939): keep the top ``top_fraction`` of response
    tokens by entropy over this batch (algorithm.high_entropy_ratio; the paper uses 0.2).

    k = ceil(top_fraction * n_masked); tokens with entropy >= the k-th largest are kept (ties may keep a
    few more). Returns a (B, T) mask in mask_BT's dtype. Left out: a global threshold across ranks
    (the quantile is per rank's batch).
    """
    if top_fraction >= 1.0:
        return mask_BT.clone()
    valid_BT = mask_BT > 0
    vals_N = entropy_BT.detach()[valid_BT]
    if vals_N.numel() == 0:
        return torch.zeros_like(mask_BT)
    k = max(1, math.ceil(top_fraction * vals_N.numel()))
    threshold = torch.topk(vals_N, k).values[-1]
    return (valid_BT & (entropy_BT.detach() >= threshold)).to(mask_BT.dtype)
