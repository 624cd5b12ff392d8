"""Pairwise preference losses for scalar reward models: pure functions on reward tensors.

Every loss takes the rewards of the chosen and rejected responses of B pairs (shape ``(B,)`` or
``(B, H)`` for H reward heads; per-pair tensors of shape ``(B,)`` broadcast over heads) and returns
the loss of every pair, same shape as the rewards. The trainer averages it.

Ties: a pair marked ``tie`` contributes the same loss with the target probability 1/2 instead of 1
(soft-label cross-entropy), i.e. ``0.5 * (l(d) + l(-d))`` where ``l`` is the loss of a strict pair
as a function of the reward difference. It is symmetric in the two responses and smallest when
``r_c = r_r``, so a tie pulls the two rewards together instead of being skipped. Margins do not apply
to tie pairs.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def _tie_mix(strict: torch.Tensor, tied: torch.Tensor, tie: torch.Tensor | None) -> torch.Tensor:
    """``strict`` (the loss with target 1) where not tie, ``tied`` (target 1/2) where tie."""
    if tie is None:
        return strict
    return torch.where(_per_pair(tie.bool(), strict), tied, strict)


def _per_pair(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (B,) per-pair tensor shaped to broadcast against rewards of shape (B,) or (B, H)."""
    return x.reshape(x.shape[0], *([1] * (like.dim() - 1)))


def bradley_terry(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: torch.Tensor | None = None,
                  tie: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
    """Bradley–Terry negative log-likelihood (Bradley & Terry 1952; Ouyang et al. 2022, InstructGPT;
    margin as in Touvron et al. 2023, Llama 2):

        loss = -log sigmoid(r_c - r_r - m)

    with ``m`` the per-pair margin (0 when None). Tie pairs (margin ignored):
    ``-(1/2) log sigmoid(d) - (1/2) log sigmoid(-d)``, ``d = r_c - r_r``. ``temperature`` is unused.
    """
    del temperature
    d = r_chosen - r_rejected
    shifted = d - _per_pair(margin.to(d.dtype), d) if margin is not None else d
    return _tie_mix(-F.logsigmoid(shifted), -0.5 * (F.logsigmoid(d) + F.logsigmoid(-d)), tie)


def log_exp(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: torch.Tensor | None = None,
            tie: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
    """Log-exp loss (the pairwise logistic ranking loss, e.g. Burges et al. 2005, RankNet; OpenRLHF's
    ``LogExpLoss``):

        loss = log(1 + exp(r_r - r_c))

    computed as softplus for stability. Equal to Bradley–Terry without margin; ``margin`` and
    ``temperature`` are not used (pass bradley_terry for margins). Tie pairs: the symmetric mix.
    """
    del margin, temperature
    d = r_chosen - r_rejected
    return _tie_mix(F.softplus(-d), 0.5 * (F.softplus(-d) + F.softplus(d)), tie)


def hps(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: torch.Tensor | None = None,
        tie: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
    """HPS loss (Wu et al. 2023, Human Preference Score v2): cross-entropy of a softmax over the pair
    ``[r_c, r_r] / T`` with the chosen response as the target:

        loss = -log( exp(r_c / T) / (exp(r_c / T) + exp(r_r / T)) )

    ``T`` is ``temperature`` (> 0). Tie pairs use the target ``[1/2, 1/2]``. ``margin`` is not used.
    """
    del margin
    if temperature <= 0:
        raise ValueError(f"hps temperature={temperature} must be > 0 (set train.temperature)")
    logits = torch.stack([r_chosen, r_rejected], dim=-1) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return _tie_mix(-logp[..., 0], -0.5 * (logp[..., 0] + logp[..., 1]), tie)


PairLoss = Callable[..., torch.Tensor]

# loss name (RM config train.loss) -> per-pair loss function
PAIR_LOSSES: dict[str, PairLoss] = {"bradley_terry": bradley_terry, "log_exp": log_exp, "hps": hps}


def pairwise_accuracy(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> float:
    """Fraction of pairs with ``r_c > r_r`` (a tie in reward counts as wrong)."""
    return (r_chosen > r_rejected).float().mean().item() if r_chosen.numel() else float("nan")
