"""KL estimators between the policy and the reference, and KL coefficient controllers.

Schulman's estimators ("Approximating KL Divergence", 2020) of KL(pi || ref) on samples from pi, with
x = log ref(y_t) - log pi(y_t):  k1 = -x,  k2 = x^2 / 2,  k3 = exp(x) - 1 - x (unbiased, >= 0).
All are per token, (B, T) -> (B, T); masking is the caller's (aggregate_loss or token_rewards).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from streamrft.config.algorithm import AlgorithmConfig


def kl_k1(logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    return logp_BT - ref_logp_BT


def kl_k2(logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    return 0.5 * (logp_BT - ref_logp_BT) ** 2


def kl_k3(logp_BT: Tensor, ref_logp_BT: Tensor) -> Tensor:
    x_BT = ref_logp_BT - logp_BT
    return torch.expm1(x_BT) - x_BT


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


class FixedKLController:
    """beta stays at algorithm.kl_coef."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive beta (Ziegler et al., arXiv:1909.08593, section 2.2):

    e = clip(KL_current / KL_target - 1, -c, c),  beta <- beta (1 + e * n_steps / horizon),
    c = algorithm.kl_adaptive_error_clip, n_steps the samples seen since the last update.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int, error_clip: float) -> None:
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon
        self.error_clip = error_clip

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -self.error_clip), self.error_clip)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def make_kl_controller(cfg: AlgorithmConfig) -> FixedKLController | AdaptiveKLController:
    """The controller named by algorithm.kl_ctl_type (validated by validate_algorithm)."""
    if cfg.kl_ctl_type == "adaptive":
        return AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon, cfg.kl_adaptive_error_clip)
    return FixedKLController(cfg.kl_coef)
