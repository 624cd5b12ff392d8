"""Multi-turn credit assignment over the model-token subsequence (issue 18; docs/agents.md).

A multi-turn sample's response interleaves model tokens (loss_mask 1) and observation tokens (0). The
observation tokens are not actions of the policy, so they take no part in returns: token-level
estimators (REINFORCE, REINFORCE++, GAE, ...) run on the *model-token subsequence* x_0 .. x_{n-1}
(the response with the observation spans removed), where

    r_j = sum_k turn_reward_k [j = e_k] + final_reward [j = n - 1] (+ token rewards such as -kl_coef KL_j)

with e_k the subsequence index of turn k's last model token. Discounting and GAE's bootstrap therefore
step from the last model token of a turn straight to the first model token of the next: an observation
gap neither discounts (gamma^gap) nor reads a value V at an observation position (the old behaviour
treated such a gap as V = 0 and discounted across it). The results are written back to the model
positions; observation positions stay 0.

These are pure functions of lists and tensors; the learner gathers the subsequence (rows_by_sample over
response_mask, which holds the loss mask) and scatters the advantages back.
"""

from __future__ import annotations

import torch
from torch import Tensor


def turn_end_indices(turn_starts: list[int], loss_mask: Tensor) -> list[int]:
    """Subsequence index of each turn's last model token. ``turn_starts``: response offsets of each model
    turn's first token (ascending); ``loss_mask`` (R,) 0/1 over the response. A turn with no model token
    (an empty model turn) gets the index of the previous model token (or 0 before any)."""
    mask = loss_mask.to(torch.int64)
    bounds = list(turn_starts[1:]) + [len(mask)]
    ends, seen = [], 0
    for start, stop in zip(turn_starts, bounds):
        if not 0 <= start <= stop <= len(mask):
            raise ValueError(f"turn_starts {turn_starts} do not fit a response of {len(mask)} tokens")
        seen += int(mask[start:stop].sum())
        ends.append(max(seen - 1, 0))
    return ends


def turn_token_rewards(turn_rewards: list[float], turn_ends: list[int], n_model_tokens: int) -> Tensor:
    """(n_model_tokens,) float32: each turn's reward at its last model token (rewards of turns ending on the
    same index add up)."""
    if len(turn_rewards) != len(turn_ends):
        raise ValueError(f"{len(turn_rewards)} turn rewards for {len(turn_ends)} turns")
    out = torch.zeros(n_model_tokens, dtype=torch.float32)
    for reward, end in zip(turn_rewards, turn_ends):
        if not 0 <= end < n_model_tokens:
            raise ValueError(f"turn end {end} outside the {n_model_tokens} model tokens")
        out[end] += float(reward)
    return out


def expand_to_response(values: Tensor, loss_mask: Tensor) -> Tensor:
    """Inverse of taking the subsequence: (R,) with ``values`` at the model positions, 0 elsewhere."""
    mask = loss_mask.bool()
    if int(mask.sum()) != values.numel():
        raise ValueError(f"{values.numel()} values for {int(mask.sum())} model tokens")
    out = torch.zeros(mask.shape[0], dtype=values.dtype)
    out[mask] = values
    return out
