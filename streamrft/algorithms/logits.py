"""Log-probs and entropy from logits: the single place where sampling temperature is applied.

log pi_T(y_t) = log_softmax(z_t / T)[y_t]; the learner must score with the engine's temperature, or the
ratio pi / pi_behaviour is biased. Half-precision logits are upcast to float32 first.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _scaled(logits_BTV: Tensor, temperature: float) -> Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (engine.temperature)")
    z = logits_BTV if logits_BTV.dtype in (torch.float32, torch.float64) else logits_BTV.float()
    return z / temperature if temperature != 1.0 else z


def logprobs_from_logits(logits_BTV: Tensor, targets_BT: Tensor, temperature: float = 1.0) -> Tensor:
    """(B, T) log-prob of each target token under softmax(logits / temperature)."""
    logp_BTV = torch.log_softmax(_scaled(logits_BTV, temperature), dim=-1)
    return logp_BTV.gather(-1, targets_BT.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits_BTV: Tensor, temperature: float = 1.0) -> Tensor:
    """(B, T) H = logsumexp(z) - sum_v softmax(z)_v z_v with z = logits / temperature.

    z is shifted by its row max first (H is shift-invariant), so large logits lose no precision.
    """
    z_BTV = _scaled(logits_BTV, temperature)
    z_BTV = z_BTV - z_BTV.amax(dim=-1, keepdim=True).detach()
    p_BTV = torch.softmax(z_BTV, dim=-1)
    return torch.logsumexp(z_BTV, dim=-1) - (p_BTV * z_BTV).sum(dim=-1)


def entropy_from_logits_chunked(logits_BTV: Tensor, temperature: float = 1.0, chunk_rows: int = 1024) -> Tensor:
    """entropy_from_logits over chunks of B*T rows, bounding the (rows, V) float32 temporaries."""
    B, T, V = logits_BTV.shape
    flat_NV = logits_BTV.reshape(B * T, V)
    parts = [entropy_from_logits(flat_NV[i : i + chunk_rows], temperature) for i in range(0, B * T, chunk_rows)]
    return torch.cat(parts).reshape(B, T) if parts else logits_BTV.new_zeros(B, T, dtype=torch.float32)
