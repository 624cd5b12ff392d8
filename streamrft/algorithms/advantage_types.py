"""Inputs, outputs and the Estimator entry shared by every advantage estimator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from torch import Tensor

from streamrft.algorithms._masked import mask_out
from streamrft.config.algorithm import AlgorithmConfig

AllReduceSum = Callable[[Tensor], Tensor]


@dataclass
class AdvantageInputs:
    rewards: Tensor  # (B,) float sequence reward
    group_index: Tensor  # (B,) int64; the samples of one prompt share an index (any order in the batch)
    response_mask: Tensor  # (B, T) float 0/1 over response tokens
    token_rewards: Tensor | None = None  # (B, T) e.g. -kl_coef * kl (kl_mode=reward) or teacher - student logp
    values: Tensor | None = None  # (B, T) critic values at response tokens (gae)


@dataclass
class AdvantageOutputs:
    advantages: Tensor  # (B, T), exactly 0 where response_mask is 0
    returns: Tensor | None = None  # (B, T) value targets / discounted returns; None for group estimators


@dataclass(frozen=True)
class Estimator:
    # fn(inp, cfg, all_reduce_sum=identity) -> AdvantageOutputs
    fn: Callable[..., AdvantageOutputs]
    # "group": computable on one complete prompt group alone; "batch": needs the whole step batch
    # (global statistics across ranks through all_reduce_sum)
    scope: Literal["group", "batch"]
    needs_critic: bool = False


def clip_advantages(adv_BT: Tensor, clip: float) -> Tensor:
    """Clamp advantages to [-clip, clip]; clip <= 0 means off (config: algorithm.advantage_clip)."""
    return adv_BT.clamp(-clip, clip) if clip > 0 else adv_BT


def finish(adv_BT: Tensor, mask_BT: Tensor, cfg: AlgorithmConfig) -> Tensor:
    """Last step of every estimator: optional clip (algorithm.advantage_clip), zero outside the mask."""
    return mask_out(clip_advantages(adv_BT, cfg.advantage_clip), mask_BT)
