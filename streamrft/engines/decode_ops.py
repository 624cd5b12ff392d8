"""The fused operations of one static-cache decode step, as plain torch functions (the reference).

``hf_fast.StaticDecoder`` runs a decode step as a handful of operations per layer:

    res, h = add_rmsnorm(res, delta, w)        # residual add + RMSNorm, rounded like the HF modules
    qkv    = linear(h, W_qkv, b_qkv)           # one GEMM for q, k and v
    o      = decode_attention(qkv, cache, ...) # rotary on q/k, write k/v at this step's slot, attend
    delta  = linear(o, W_o)
    res, h = add_rmsnorm(res, delta, w2)
    delta  = linear(silu_mul(linear(h, W_gate_up)), W_down)

and samples with ``race_sample``. This module holds the torch versions (CPU, or a GPU without Triton);
``triton_decode.py`` holds kernels with the same signatures and the same arithmetic, each one launch.

Sampling is an exponential race (the Gumbel-max trick): with ``E_v ~ Exp(1)`` independent per vocabulary
entry, ``argmax_v (z_v - log E_v)`` is distributed exactly as ``softmax(z)``. The ``E_v`` come from a
counter-based hash of (row seed, step, v), so a row's draw depends only on its own seed, step and logits,
never on its batch, and a kernel can draw them in registers: one pass over the logits, no cumulative sum,
no host sync. Two 32-bit hash words give ``u`` with 64 bits of resolution near 0, so ``E = -log(1 - u)``
keeps its relative precision for the small values that decide the race.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

M32 = 0xFFFFFFFF
MIX_MUL = 0x45D9F3B  # < 2**31: products of 32-bit values stay below 2**63 in int64
VOCAB_MUL = 0x27D4EB2F
WORD2_XOR = 0x5BD1E995
STEP_ADD = 0x9E3779B9
SMALL_U = 1e-3  # below this, E = -log(1 - u) from its series (1 - u would round in float32)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply) on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * MIX_MUL) & M32
    x = x ^ (x >> 16)
    x = (x * MIX_MUL) & M32
    return x ^ (x >> 16)


def row_keys(seeds_B: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """A 32-bit key per row (int64), a pure function of (row seed, step index)."""
    lo, hi = seeds_B & M32, (seeds_B >> 32) & M32
    s = mix32((step.to(torch.int64) + STEP_ADD) & M32)
    return mix32(lo ^ mix32(hi ^ s))


def race_uniform(keys_B: torch.Tensor, vocab: int) -> torch.Tensor:
    """u ∈ [0, 1] (float32) per (row, vocabulary entry), from two hash words: a·2⁻³² + b·2⁻⁶⁴."""
    v_V = (torch.arange(vocab, device=keys_B.device, dtype=torch.int64) * VOCAB_MUL) & M32
    a_BV = mix32(keys_B.unsqueeze(-1) ^ v_V)
    b_BV = mix32(a_BV ^ WORD2_XOR)
    return a_BV.float() * 2.0 ** -32 + b_BV.float() * 2.0 ** -64


def race_exponential(u: torch.Tensor) -> torch.Tensor:
    """E = -log(1 - u) ~ Exp(1), with the series u + u²/2 + u³/3 where 1 - u would lose precision."""
    series = u * (1.0 + u * (0.5 + u * (1.0 / 3.0)))
    return torch.where(u < SMALL_U, series, -torch.log(1.0 - u))


def race_sample(logits_BV: torch.Tensor, inv_temperature: float, seeds_B: torch.Tensor,
                step: torch.Tensor, need_B: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from ``softmax(logits · inv_temperature)``; returns (tokens int64, log-probs fp32).

    Entries at ``-inf`` (top-k / top-p masks) are never drawn. Ties go to the lowest index. ``need_B``: how
    many tokens each row needs; a row with ``step >= need_B[row]`` is finished and its draw is not used (the
    Triton kernel skips it; here every row is drawn: dense torch ops save nothing by skipping rows)."""
    z_BV = logits_BV.float() * inv_temperature
    e_BV = race_exponential(race_uniform(row_keys(seeds_B, step), z_BV.shape[-1]))
    score_BV = torch.where(z_BV > float("-inf"), z_BV - torch.log(e_BV), float("-inf"))
    tokens_B = torch.argmax(score_BV, dim=-1)
    logp_B = z_BV.gather(-1, tokens_B.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z_BV, dim=-1)
    return tokens_B, logp_B


def add_rmsnorm(res_BH: torch.Tensor, delta_BH: torch.Tensor | None, weight_H: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(res + delta, RMSNorm(res + delta) · weight), rounded as Qwen2/Llama RMSNorm rounds.

    The sum is rounded to the model dtype, normalised in float32, rounded back, then scaled by the
    weight in the model dtype (``weight * h.to(dtype)``)."""
    if delta_BH is not None:
        res_BH = res_BH + delta_BH
    h = res_BH.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return res_BH, weight_H * h.to(res_BH.dtype)


def silu_mul(gate_up_BI2: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for the concatenated [gate | up] projection output."""
    gate, up = gate_up_BI2.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_cos_sin(pos_B: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin (..., d) of the rotary embedding at positions ``pos_B`` (any shape; rotate-half layout)."""
    freqs = pos_B.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in rotate-half form, in x's dtype: x (B, H, ..., d), cos/sin (B, ..., d) shared
    by the H heads (decode: x (B, H, d); prefill: x (B, H, T, d))."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def decode_attention(qkv_BX: torch.Tensor, prompt_k: torch.Tensor, prompt_v: torch.Tensor, gen_k: torch.Tensor,
                     gen_v: torch.Tensor, prompt_row_B: torch.Tensor, start_B: torch.Tensor, step: torch.Tensor,
                     pos_B: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float, sm_scale: float, n_heads: int,
                     n_kv: int, need_B: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per row over its cache; writes this token's k/v first.

    ``need_B`` as in ``race_sample``: a finished row's output is not used (the Triton kernel reads no cache for
    it; here every row attends).

    The cache has two parts. ``prompt_k, prompt_v (U, n_kv, Lp, d)`` hold the left-padded prompts once per
    distinct prompt: row b's prompt is entry ``prompt_row_B[b]``, live from slot ``start_B[b]``, so the
    samples of a GRPO group read one copy. ``gen_k, gen_v (B, n_kv, G, d)`` hold each row's own generated
    tokens: the token fed at decode step ``step`` (token ``step - 1``) goes to slot ``step - 1``, and row b
    attends to its prompt's live slots and to its generated slots ``0 .. step - 1``.

    ``qkv_BX = [q (n_heads·d) | k (n_kv·d) | v (n_kv·d)]``; rotary (float32, then rounded) at ``pos_B``.
    Query head h uses KV head ``h // (n_heads // n_kv)``. Returns (B, n_heads·d)."""
    B, d = qkv_BX.shape[0], gen_k.shape[-1]
    q = qkv_BX[:, : n_heads * d].view(B, n_heads, d)
    k = qkv_BX[:, n_heads * d: (n_heads + n_kv) * d].view(B, n_kv, d)
    v = qkv_BX[:, (n_heads + n_kv) * d:].view(B, n_kv, d)
    cos, sin = rope_cos_sin(pos_B, inv_freq, rope_scale)
    q, k = rotate_half(q.float(), cos, sin).to(q.dtype), rotate_half(k.float(), cos, sin).to(k.dtype)
    gen_slot_1 = step.reshape(1) - 1
    gen_k.index_copy_(2, gen_slot_1, k.unsqueeze(2))
    gen_v.index_copy_(2, gen_slot_1, v.unsqueeze(2))
    k_all = torch.cat((prompt_k.index_select(0, prompt_row_B), gen_k), dim=2)
    v_all = torch.cat((prompt_v.index_select(0, prompt_row_B), gen_v), dim=2)
    Lp = prompt_k.shape[2]
    slots_S = torch.arange(k_all.shape[2], device=k_all.device)
    live_prompt_BS = (slots_S >= start_B.unsqueeze(-1)) & (slots_S < Lp)
    live_gen_S = (slots_S >= Lp) & (slots_S - Lp <= gen_slot_1)
    ok_B11S = (live_prompt_BS | live_gen_S).view(B, 1, 1, -1)
    q_g = q.view(B, n_kv, n_heads // n_kv, d)
    o = F.scaled_dot_product_attention(q_g, k_all, v_all, attn_mask=ok_B11S, scale=sm_scale)
    return o.reshape(B, n_heads * d)


__all__ = ["add_rmsnorm", "decode_attention", "mix32", "race_exponential", "race_sample", "race_uniform",
           "rope_cos_sin", "rotate_half", "row_keys", "silu_mul"]
