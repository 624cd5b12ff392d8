"""Reward and advantage normalisation with global (all-rank) statistics.

``all_reduce_sum`` is the caller's all-reduce (torch.distributed SUM across ranks, or identity on one
rank); every statistic here is computed from global sums, never per rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from streamrft.algorithms._masked import identity, mask_out, masked_global_mean_std, standardise


def whiten_advantages(
    adv_BT: Tensor, mask_BT: Tensor, all_reduce_sum=identity, eps: float = 1e-6, shift_mean: bool = True
) -> Tensor:
    """A' = (A - mu) / (sigma + eps) over the masked tokens of the global batch (sigma unbiased).

    shift_mean=False keeps the mean (A' = A / (sigma + eps)). eps is algorithm.norm_eps. Statistics and
    the division are float64 (masked_global_mean_std, standardise); the result has adv_BT's dtype.
    """
    mean, std = masked_global_mean_std(adv_BT, mask_BT, all_reduce_sum)
    return mask_out(standardise(adv_BT, mean, std, eps, shift_mean), mask_BT)


def clip_rewards(rewards_B: Tensor, clip: float) -> Tensor:
    """Clamp rewards to [-clip, clip]; clip <= 0 means off (config: algorithm.reward_clip)."""
    return rewards_B.clamp(-clip, clip) if clip > 0 else rewards_B


class RunningMeanStd:
    """Running mean / population variance of a reward stream, merged across ranks (Chan et al. 1979).

    update(x): two all-reduces in float64, [n, sum x] then sum (x - mean_b)^2, give the step's global
    batch mean and population variance, merged into the running state by
        delta = mean_b - mean,  N' = N + n,  mean' = mean + delta n / N',
        M2' = var N + var_b n + delta^2 N n / N',  var' = M2' / N'.
    normalize(x) = (x - mean) / (sqrt(var) + eps). State is three float64 tensors (checkpointable),
    identical on every rank after each update.
    """

    def __init__(self, eps: float = 1e-6) -> None:
        self.eps = eps
        self.count = torch.zeros((), dtype=torch.float64)
        self.mean = torch.zeros((), dtype=torch.float64)
        self.var = torch.ones((), dtype=torch.float64)

    def update(self, x: Tensor, all_reduce_sum=identity) -> None:
        x64 = x.detach().reshape(-1).to(torch.float64)
        # Two passes (global mean, then squared deviations from it): the one-pass s2/n - mean^2 cancels
        # when the rewards share a large offset.
        n, s1 = (v.cpu() for v in all_reduce_sum(torch.stack([x64.new_tensor(float(x64.numel())), x64.sum()])).unbind(0))
        if n.item() == 0:
            return
        mean_b = s1 / n
        dev = x64 - mean_b.to(x64.device)
        (ss,) = (v.cpu() for v in all_reduce_sum((dev * dev).sum().reshape(1)).unbind(0))
        var_b = ss / n
        total = self.count + n
        delta = mean_b - self.mean
        m2 = self.var * self.count + var_b * n + delta * delta * self.count * n / total
        self.mean = self.mean + delta * n / total
        self.var = m2 / total
        self.count = total

    def normalize(self, x: Tensor) -> Tensor:
        mean = self.mean.to(device=x.device)
        std = self.var.sqrt().to(device=x.device)
        return standardise(x, mean, std, self.eps)

    def state_dict(self) -> dict[str, Tensor]:
        return {"count": self.count.clone(), "mean": self.mean.clone(), "var": self.var.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.count = state["count"].to(torch.float64).clone()
        self.mean = state["mean"].to(torch.float64).clone()
        self.var = state["var"].to(torch.float64).clone()
