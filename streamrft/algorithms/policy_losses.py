"""Policy losses: per-token loss (B, T) before aggregation, plus per-token metrics.

Notation: rho_t = pi(y_t) / pi_prox(y_t) = exp(logp - old_logp); A_t the advantage; eps_l, eps_h =
algorithm.clip_eps_low / clip_eps_high. ppo_clip, clip_higher, dual_clip, gspo and cpg honour both;
gmpo does not: it clips log rho_t to [-gmpo_clip_eps, gmpo_clip_eps], the paper's own symmetric range
in log space (config/variants.py refuses clip_eps_low/high written with policy_loss=gmpo).
``old_logp`` is the proximal policy (the learner's log-probs at step start); ``behaviour_logp`` is the
engine's sampling log-prob.

Off-policy correction (decoupled PPO, arXiv:2110.00641): every loss is multiplied by the detached
weight of ``streamrft.algorithms.offpolicy.offpolicy_weight``: truncated IS min(pi_prox / pi_beh,
tis_cap) per token or sequence (algorithm.tis_mode) times a 0/1 mask of tokens or sequences whose
pi_prox / pi_beh leaves [offpolicy_mask_low, offpolicy_mask_high] (algorithm.offpolicy_mask).
behaviour_logp=None gives weight 1.

float32 safety: every exp of a log-ratio goes through ratios.bounded_exp (capped at e^20, zero gradient
beyond), so a token with log rho = +-100 gives a finite loss and finite gradients, equal to the
paper's formula wherever that is finite and the log-ratio is below the cap (see ratios.py).

Sequence-level losses (gspo, gmpo) write a value on every response token such that
seq-mean-token-mean aggregation reproduces the paper's per-sequence objective exactly; with token-mean
a sequence weighs in proportion to its length.

Metrics (all (B, T), zero outside the mask, detached): ratio, clipped (0/1; a token whose ratio was
held at the cap counts as clipped), tis_weight, tis_clipped (0/1), offpolicy_masked (0/1),
behaviour_proximal_kl, plus dual_clipped for dual_clip and drift for cpg. Left out: the entropy bonus
and KL-in-loss (the learner adds ``- entropy_coef * H`` and ``kl_coef * KL_ESTIMATORS[kl_estimator]``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from streamrft.algorithms._masked import mask_out
from streamrft.algorithms.offpolicy import offpolicy_weight
from streamrft.algorithms.ratios import bounded_exp, over_cap
from streamrft.config.algorithm import AlgorithmConfig


@dataclass
class PolicyLossInputs:
    logp: Tensor  # (B, T) current policy log-probs of the sampled tokens (with grad)
    old_logp: Tensor  # (B, T) learner's log-probs at the start of the step (no grad)
    advantages: Tensor  # (B, T)
    mask: Tensor  # (B, T) float 0/1 over response tokens
    behaviour_logp: Tensor | None = None  # (B, T) engine's sampling log-probs (for TIS); None = on-policy


@dataclass
class PolicyLossOutput:
    loss: Tensor  # (B, T) per-token loss before aggregation, 0 outside the mask
    metrics: dict[str, Tensor] = field(default_factory=dict)  # name -> (B, T) per-token quantity


def tis_weight(inp: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """(w_BT, clipped_BT): detached truncated IS weight min(pi_prox / pi_beh, tis_cap) and where it hit the cap
    (algorithm.tis_mode; the masking of offpolicy_mask is not included)."""
    _, metrics = offpolicy_weight(inp.old_logp, inp.behaviour_logp, inp.mask, cfg)
    return metrics["tis_weight"], metrics["tis_clipped"]


def _ppo_terms(ratio_BT: Tensor, adv_BT: Tensor, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """max(-A rho, -A clip(rho, 1 - eps_l, 1 + eps_h)) and where the clipped branch is active."""
    pg1_BT = -adv_BT * ratio_BT
    pg2_BT = -adv_BT * ratio_BT.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    return torch.maximum(pg1_BT, pg2_BT), (pg2_BT > pg1_BT)


def _finish(loss_BT: Tensor, inp: PolicyLossInputs, cfg: AlgorithmConfig, **metrics: Tensor) -> PolicyLossOutput:
    w_BT, off_metrics = offpolicy_weight(inp.old_logp, inp.behaviour_logp, inp.mask, cfg)
    out = {**off_metrics, **metrics}
    out = {k: mask_out(v.detach().to(loss_BT.dtype), inp.mask) for k, v in out.items()}
    return PolicyLossOutput(mask_out(loss_BT * w_BT.to(loss_BT.dtype), inp.mask), out)


def ppo_clip(inp: PolicyLossInputs, cfg: AlgorithmConfig) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al., arXiv:1707.06347), with asymmetric eps_l / eps_h:

    L_t = max(-A_t rho_t, -A_t clip(rho_t, 1 - eps_l, 1 + eps_h)),  rho_t = bounded_exp(log rho_t).
    """
    log_rho_BT = inp.logp - inp.old_logp.detach()
    ratio_BT = bounded_exp(log_rho_BT)
    loss_BT, clipped_BT = _ppo_terms(ratio_BT, inp.advantages, cfg)
    return _finish(loss_BT, inp, cfg, ratio=ratio_BT, clipped=clipped_BT | over_cap(log_rho_BT))


def clip_higher(inp: PolicyLossInputs, cfg: AlgorithmConfig) -> PolicyLossOutput:
    """DAPO clip-higher (Yu et al., arXiv:2503.14476): ppo_clip with eps_h > eps_l (e.g. 0.2 / 0.28).

    The formula is ppo_clip's; the name exists so validate_algorithm can insist on eps_h > eps_l.
    """
    return ppo_clip(inp, cfg)


def dual_clip(inp: PolicyLossInputs, cfg: AlgorithmConfig) -> PolicyLossOutput:
    """Dual-clip PPO (Ye et al., arXiv:1912.09729): for A_t < 0 the loss is also bounded by -c A_t,

    L_t = min(L_ppo_t, -c A_t) if A_t < 0 else L_ppo_t,  c = algorithm.dual_clip_c > 1.
    """
    log_rho_BT = inp.logp - inp.old_logp.detach()
    ratio_BT = bounded_exp(log_rho_BT)
    ppo_BT, clipped_BT = _ppo_terms(ratio_BT, inp.advantages, cfg)
    bound_BT = -cfg.dual_clip_c * inp.advantages
    neg_BT = inp.advantages < 0
    dual_BT = neg_BT & (bound_BT < ppo_BT)
    loss_BT = torch.where(neg_BT, torch.minimum(ppo_BT, bound_BT), ppo_BT)
    clipped_BT = clipped_BT | dual_BT | over_cap(log_rho_BT)
    return _finish(loss_BT, inp, cfg, ratio=ratio_BT, clipped=clipped_BT, dual_clipped=dual_BT)


def gspo(inp: PolicyLossInputs, cfg: AlgorithmConfig) -> PolicyLossOutput:
    """GSPO (Zheng et al., arXiv:2507.18071), in its GSPO-token form:

    s_i = exp((1/|y_i|) sum_t log rho_t)  (length-normalised sequence ratio),
    s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]  (value s_i, gradient s_i * grad log pi(y_t)),
    L_t = max(-A_t s_it, -A_t clip(s_it, 1 - eps_l, 1 + eps_h)).
    With A constant over a sequence and seq-mean-token-mean aggregation this is exactly GSPO. The
    paper's eps are small (3e-4 / 4e-4): set clip_eps_low / clip_eps_high accordingly. A sequence
    whose mean log-ratio passes LOG_RATIO_CAP gets s_i = e^cap and no gradient (bounded_exp's rule).
    """
    log_rho_BT = mask_out(inp.logp - inp.old_logp.detach(), inp.mask)
    n_B = inp.mask.sum(dim=1).clamp(min=1)
    log_s_B1 = (log_rho_BT.sum(dim=1) / n_B)[:, None].detach()
    live_B1 = (~over_cap(log_s_B1)).to(inp.logp.dtype)  # past the cap the ratio is a constant
    ratio_BT = bounded_exp(log_s_B1) * torch.exp((inp.logp - inp.logp.detach()) * live_B1)
    loss_BT, clipped_BT = _ppo_terms(ratio_BT, inp.advantages, cfg)
    clipped_BT = clipped_BT | over_cap(log_s_B1).expand_as(clipped_BT)
    return _finish(loss_BT, inp, cfg, ratio=ratio_BT, clipped=clipped_BT)


def gmpo(inp: PolicyLossInputs, cfg: AlgorithmConfig) -> PolicyLossOutput:
    """GMPO (Zhao et al., arXiv:2507.20673): geometric mean of token ratios, clipped per token in log space.

    With A_i the sequence advantage (masked mean of A_t over the sequence) and sgn = sign(A_i):
    l_t = sgn * min(sgn * log rho_t, sgn * clip(log rho_t, -eps, eps)),  eps = algorithm.gmpo_clip_eps,
    L_i = -A_i exp((1/|y_i|) sum_t l_t), written on every response token of sequence i.
    GMPO keeps the paper's own symmetric log-space clip: clip_eps_low / clip_eps_high do not apply
    (config/variants.py refuses them with policy_loss=gmpo). The sequence exponent goes through
    bounded_exp (capped at LOG_RATIO_CAP, no gradient beyond).
    """
    log_rho_BT = inp.logp - inp.old_logp.detach()
    n_B = inp.mask.sum(dim=1).clamp(min=1)
    adv_B = mask_out(inp.advantages, inp.mask).sum(dim=1) / n_B
    sgn_B1 = torch.sign(adv_B)[:, None]
    eps = cfg.gmpo_clip_eps
    clip_BT = log_rho_BT.clamp(-eps, eps)
    l_BT = sgn_B1 * torch.minimum(sgn_B1 * log_rho_BT, sgn_B1 * clip_BT)
    expo_B = mask_out(l_BT, inp.mask).sum(dim=1) / n_B
    clipped_BT = ((sgn_B1 * clip_BT) < (sgn_B1 * log_rho_BT)) | over_cap(expo_B)[:, None]
    g_B = bounded_exp(expo_B)
    loss_BT = (-adv_B * g_B)[:, None].expand_as(log_rho_BT)
    return _finish(loss_BT, inp, cfg, ratio=bounded_exp(log_rho_BT), clipped=clipped_BT)


def cpg(inp: PolicyLossInputs, cfg: AlgorithmConfig) -> PolicyLossOutput:
    """CPGD's clipped policy gradient with policy drift (Liu et al., arXiv:2505.12504):

    L_t = max(-A_t log rho_t, -A_t clip(log rho_t, log(1 - eps_l), log(1 + eps_h)))
          + alpha (rho_t - 1 - log rho_t),
    the last term the k3 estimate of KL(pi_old || pi) on samples from pi_old, alpha =
    algorithm.cpg_drift_coef. Selected by name (policy_loss=cpg); pair with advantage_estimator=cpgd.
    The drift term is used unclipped here; its rho_t is bounded_exp(log rho_t) (the log rho_t terms
    are linear and need no bound).
    """
    log_rho_BT = inp.logp - inp.old_logp.detach()
    lo, hi = math.log(1.0 - cfg.clip_eps_low), math.log(1.0 + cfg.clip_eps_high)
    pg1_BT = -inp.advantages * log_rho_BT
    pg2_BT = -inp.advantages * log_rho_BT.clamp(lo, hi)
    ratio_BT = bounded_exp(log_rho_BT)
    drift_BT = ratio_BT - 1.0 - log_rho_BT
    loss_BT = torch.maximum(pg1_BT, pg2_BT) + cfg.cpg_drift_coef * drift_BT
    return _finish(loss_BT, inp, cfg, ratio=ratio_BT, clipped=pg2_BT > pg1_BT, drift=drift_BT)
