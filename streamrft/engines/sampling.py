"""Token sampling as pure tensor functions: logit processing, per-row seeded draws, log-probs, seeds.

The distribution a token is drawn from is

    p = softmax(mask_top_p(mask_top_k(logits / T)))

and the behaviour log-prob recorded for a sampled token ``x`` is ``log p(x)`` under exactly that
distribution (``logprob_of``), which is what importance correction in the losses needs.

Reproducibility: each sequence owns a ``torch.Generator`` seeded from
``sample_seed(run_seed, step, prompt_index, sample_index)``, and each decode step draws exactly one
uniform number from it. A sequence's tokens therefore depend only on its own seed and its own logits,
never on which other sequences share its batch or how many ranks there are.
"""

from __future__ import annotations

import hashlib

import torch

_SEED_MASK = (1 << 63) - 1


def sample_seed(run_seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """A stable 63-bit seed for one sample: blake2b over the four integers.

    Unlike Python's ``hash()``, the value is the same in every process and every Python version.
    """
    text = f"{run_seed}:{step}:{prompt_index}:{sample_index}".encode()
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def _as_column(value: float | torch.Tensor, like_BV: torch.Tensor) -> torch.Tensor:
    """A scalar or a per-row tensor (B,) as a (B, 1) tensor on the logits' device and dtype."""
    if isinstance(value, torch.Tensor):
        return value.to(device=like_BV.device, dtype=like_BV.dtype).reshape(-1, 1)
    return torch.full((like_BV.shape[0], 1), float(value), device=like_BV.device, dtype=like_BV.dtype)


def process_logits(
    logits_BV: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Temperature, then top-k, then top-p; removed tokens get ``-inf``.

    - temperature: ``logits / T``, ``T > 0``; a float or a per-row tensor of shape (B,).
    - top-k (``k > 0``): keep exactly the ``k`` largest logits of each row (ties broken by index).
    - top-p (``p < 1``): sort ``q = softmax(logits)`` descending and keep the smallest prefix whose
      mass is ``>= p`` (token ``i`` is kept iff the mass strictly before it is ``< p``). The most
      likely token is always kept, so at least one token survives.

    Returns float32 logits (B, V); greedy decoding is ``top_k=1``.
    """
    if isinstance(temperature, torch.Tensor):
        if bool((temperature <= 0).any()):
            raise ValueError(f"temperature must be > 0, got {temperature.tolist()}; set engine.temperature > 0 "
                             "(use engine.top_k=1 for greedy decoding)")
    elif temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0; set engine.temperature > 0 "
                         "(use engine.top_k=1 for greedy decoding)")
    if top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0 = off); set engine.top_k")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]; set engine.top_p")
    logits_BV = logits_BV.float() / _as_column(temperature, logits_BV.float())
    vocab = logits_BV.shape[-1]
    if 0 < top_k < vocab:
        top_idx_BK = torch.topk(logits_BV, top_k, dim=-1).indices
        keep_BV = torch.zeros_like(logits_BV, dtype=torch.bool).scatter_(-1, top_idx_BK, True)
        logits_BV = logits_BV.masked_fill(~keep_BV, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        mass_before_BV = torch.cumsum(probs_BV, dim=-1) - probs_BV
        drop_sorted_BV = mass_before_BV >= top_p
        drop_sorted_BV[:, 0] = False
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter_(-1, order_BV, drop_sorted_BV)
        logits_BV = logits_BV.masked_fill(drop_BV, float("-inf"))
    return logits_BV


def sample_tokens(logits_BV: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Draw one token per row by inverse-CDF sampling with that row's own generator.

    Row ``i`` draws ``u_i ~ U[0, 1)`` from ``generators[i]`` and returns the first token ``x`` with
    ``CDF_i(x) > u_i * CDF_i(V-1)``; tokens with probability zero are never returned. Each call consumes
    exactly one uniform from each generator, so a row's draw depends only on its generator state and its
    own logits. Returns tokens (B,) int64.
    """
    if len(generators) != logits_BV.shape[0]:
        raise ValueError(f"got {len(generators)} generators for {logits_BV.shape[0]} rows; pass one per row")
    device = logits_BV.device
    u_B = torch.cat([torch.rand(1, generator=g, device=device, dtype=torch.float64) for g in generators])
    probs_BV = torch.softmax(logits_BV.double(), dim=-1)
    cdf_BV = torch.cumsum(probs_BV, dim=-1)
    threshold_B1 = (u_B * cdf_BV[:, -1]).unsqueeze(-1)
    tokens_B = torch.searchsorted(cdf_BV, threshold_B1, right=True).squeeze(-1)
    # Guard the rounding edge u * total == total: fall back to the last token with positive mass.
    vocab = logits_BV.shape[-1]
    last_positive_B = vocab - 1 - torch.argmax(torch.flip(probs_BV > 0, dims=[-1]).int(), dim=-1)
    return torch.minimum(tokens_B, last_positive_B)


def logprob_of(processed_logits_BV: torch.Tensor, tokens_B: torch.Tensor) -> torch.Tensor:
    """``log softmax(processed_logits)[token]`` per row: the log-prob under the sampled distribution. (B,)"""
    logp_BV = torch.log_softmax(processed_logits_BV.float(), dim=-1)
    return logp_BV.gather(-1, tokens_B.long().unsqueeze(-1)).squeeze(-1)
