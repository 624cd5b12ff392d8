"""Off-policy corrections between the behaviour policy (the engine that sampled) and the proximal policy.

Decoupled PPO (Hilton et al., "Batch size-invariance for policy optimization", arXiv:2110.00641) keeps
three policies apart: the behaviour policy pi_beh that sampled y (the engine's ``behaviour_logprobs``,
possibly several versions old, possibly another kernel or precision), the proximal policy pi_prox the
PPO clip is centred on (the learner's own log-probs of the weights at the start of the step), and pi
being trained. Every policy loss clips rho = pi / pi_prox; the gap pi_prox / pi_beh is corrected here
by a detached per-token weight w_t that multiplies the loss:

    log r_t = log pi_prox(y_t) - log pi_beh(y_t)               (response tokens only)
    w_t     = TIS_WEIGHTS[algorithm.tis_mode](log r) * OFFPOLICY_MASKS[algorithm.offpolicy_mask](log r)

Where pi_prox comes from: the learner recomputes old log-probs at step start when it makes more than
one update per step (train.ppo_epochs * train.mini_batches_per_step > 1) or folds KL into the reward;
otherwise the first (and only) pass's detached log-probs are exactly pi_prox (same weights, same batch),
and the loss uses those. Either way pi_prox is the learner's policy at step start, never the engine's.

The two families compose: IcePop (Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for
Trillion-Scale Thinking Model", 2025: w = r inside [alpha, beta], 0 outside) is tis_mode=token with
tis_cap >= offpolicy_mask_high plus offpolicy_mask=token; masked importance sampling (MIS) is the same
with offpolicy_mask_low=0; plain decoupled PPO with TIS is offpolicy_mask=off (the default). A masked
token keeps its place in the aggregation denominators (its loss is 0, as in IcePop). The window
[offpolicy_mask_low, offpolicy_mask_high] bounds pi_prox / pi_beh (IcePop's pi_train / pi_infer, the
same direction as the IS weight); for behaviour / proximal use [1 / high, 1 / low]. Sequence masking
averages over the tokens of the loss mask (after algorithm.high_entropy_ratio's token filter).

Metrics (B, T), detached: tis_weight, tis_clipped (0/1), offpolicy_masked (0/1), and
behaviour_proximal_kl, the k3 estimate (Schulman, "Approximating KL divergence", 2020) of
KL(pi_beh || pi_prox) on tokens sampled from pi_beh: r - 1 - log r.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from streamrft.algorithms._masked import mask_out
from streamrft.algorithms.ratios import LOG_RATIO_CAP


def behaviour_log_ratio(proximal_logp_BT: Tensor, behaviour_logp_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """log r_t = log pi_prox(y_t) - log pi_beh(y_t), detached, exactly 0 outside the mask."""
    prox_BT = proximal_logp_BT.detach()
    return mask_out(prox_BT - behaviour_logp_BT.detach().to(prox_BT.dtype), mask_BT)


def _seq_sum(x_BT: Tensor) -> Tensor:
    return x_BT.sum(dim=1, keepdim=True).expand_as(x_BT)


# --- truncated importance sampling: (log_r_BT, mask_BT, cap) -> (w_BT, clipped_BT) -----------------

def tis_token(log_r_BT: Tensor, mask_BT: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """Token TIS (Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
    2025): w_t = min(r_t, C), C = algorithm.tis_cap; taken in log space so it never overflows."""
    log_cap = math.log(cap)
    return log_r_BT.clamp(max=log_cap).exp(), (log_r_BT > log_cap).to(log_r_BT.dtype)


def tis_sequence(log_r_BT: Tensor, mask_BT: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """Sequence TIS: w_t = min(prod_{s in y} r_s, C) on every token of the sequence (the unbiased
    sequence-level weight, truncated); the product is a sum of logs, so a long sequence cannot overflow."""
    return tis_token(_seq_sum(mask_out(log_r_BT, mask_BT)), mask_BT, cap)


def tis_off(log_r_BT: Tensor, mask_BT: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """No IS weight: w_t = 1 (the behaviour policy is trusted to be the proximal one)."""
    return torch.ones_like(log_r_BT), torch.zeros_like(log_r_BT)


TIS_WEIGHTS: dict[str, Callable[[Tensor, Tensor, float], tuple[Tensor, Tensor]]] = {
    "token": tis_token,
    "sequence": tis_sequence,
    "off": tis_off,
}


# --- masking out of a trust window: (log_r_BT, mask_BT, low, high) -> keep_BT (0/1) ---------------

def _inside(log_x: Tensor, low: float, high: float) -> Tensor:
    log_low = math.log(low) if low > 0 else -math.inf  # low = 0: no lower bound (MIS)
    return ((log_x >= log_low) & (log_x <= math.log(high))).to(log_x.dtype)


def mask_token(log_r_BT: Tensor, mask_BT: Tensor, low: float, high: float) -> Tensor:
    """Token masking (IcePop; MIS with low = 0): keep_t = [low <= r_t <= high], low/high =
    algorithm.offpolicy_mask_low / offpolicy_mask_high. Compared in log space (no overflow)."""
    return mask_out(_inside(log_r_BT, low, high), mask_BT)


def mask_sequence(log_r_BT: Tensor, mask_BT: Tensor, low: float, high: float) -> Tensor:
    """Sequence masking by the geometric mean ratio: g_i = exp((1/|y_i|) sum_t log r_t) over the
    sequence's masked tokens; keep every token of sequence i iff low <= g_i <= high. The geometric
    mean (not the product) keeps the window independent of the length."""
    n_B1 = mask_BT.sum(dim=1, keepdim=True).clamp(min=1)
    log_g_B1 = mask_out(log_r_BT, mask_BT).sum(dim=1, keepdim=True) / n_B1
    return mask_out(_inside(log_g_B1, low, high).expand_as(log_r_BT), mask_BT)


def mask_off(log_r_BT: Tensor, mask_BT: Tensor, low: float, high: float) -> Tensor:
    """No masking: keep every response token."""
    return mask_out(torch.ones_like(log_r_BT), mask_BT)


OFFPOLICY_MASKS: dict[str, Callable[[Tensor, Tensor, float, float], Tensor]] = {
    "token": mask_token,
    "sequence": mask_sequence,
    "off": mask_off,
}


def behaviour_proximal_kl(log_r_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """k3 estimate of KL(pi_beh || pi_prox) per token sampled from pi_beh: r - 1 - log r >= 0.

    log r is bounded to [-LOG_RATIO_CAP, LOG_RATIO_CAP] first so a single wild token (e.g. a behaviour
    log-prob of -1e4) reports a large, finite number instead of inf. Computed as expm1(x) - x: near
    on-policy (|x| ~ 1e-5) exp(x) - 1 - x is all rounding and came out slightly negative in float32;
    float64 keeps its x^2 / 2."""
    x_BT = log_r_BT.clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP).to(torch.float64)  # x^2/2 is below float32's ulp of x
    return mask_out((torch.expm1(x_BT) - x_BT).clamp(min=0.0).to(log_r_BT.dtype), mask_BT)


def offpolicy_weight(
    proximal_logp_BT: Tensor, behaviour_logp_BT: Tensor | None, mask_BT: Tensor, cfg
) -> tuple[Tensor, dict[str, Tensor]]:
    """(w_BT, metrics): the detached weight tis * keep and its per-token metrics (see the module doc).

    behaviour_logp=None (an on-policy sample with no engine log-probs) gives w = 1 and zero metrics."""
    prox_BT = proximal_logp_BT.detach()
    if behaviour_logp_BT is None:
        zeros_BT = torch.zeros_like(prox_BT)
        ones_BT = torch.ones_like(prox_BT)
        return ones_BT, {"tis_weight": ones_BT, "tis_clipped": zeros_BT, "offpolicy_masked": zeros_BT,
                         "behaviour_proximal_kl": zeros_BT}
    log_r_BT = behaviour_log_ratio(prox_BT, behaviour_logp_BT, mask_BT)
    w_BT, tis_clipped_BT = TIS_WEIGHTS[cfg.tis_mode](log_r_BT, mask_BT, cfg.tis_cap)
    keep_BT = OFFPOLICY_MASKS[cfg.offpolicy_mask](log_r_BT, mask_BT, cfg.offpolicy_mask_low, cfg.offpolicy_mask_high)
    metrics = {
        "tis_weight": w_BT,
        "tis_clipped": tis_clipped_BT,
        "offpolicy_masked": mask_out(1.0 - keep_BT, mask_BT),
        "behaviour_proximal_kl": behaviour_proximal_kl(log_r_BT, mask_BT),
    }
    return w_BT * keep_BT, metrics
