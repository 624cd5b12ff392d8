"""FLOP and byte counts of the GRPO benchmark workload (Qwen2-shaped decoders), and the roofline probes.

For a decoder with hidden H, layers Lyr, heads n_h (head dim d), KV heads n_kv, MLP width I, vocab V:

    N_body = Lyr·(H·n_h·d + 2·H·n_kv·d + n_h·d·H + 3·H·I)       (matmul weights, biases ignored)
    forward FLOPs / token = 2·N_body + 2·n_h·d·Lyr·2·ctx (scores + values) + 2·H·V (head, where needed)
    training = 3 × forward (backward twice the forward); causal attention over L tokens: ctx ≈ L/2.

Decode step of B rows at context c: bytes ≥ 2·(N_body + V·H) + Lyr·2·B·n_kv·c·d·2 (bf16 weights and KV read
once), FLOPs = B·(2·N_body + 2·V·H + 4·n_h·d·Lyr·c); the floor is max(bytes / bandwidth, FLOPs / matmul rate).
A ragged batch (``lengths``: each row's new tokens, the long-tailed workload) counts at each step only the rows
still decoding: row i's first token comes from the prefill and its last from decode step lengths[i] − 1.
"""

from __future__ import annotations

import time

import torch


def shape_of(cfg) -> dict[str, int]:
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    H, n_h, n_kv, I = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    body = cfg.num_hidden_layers * (H * n_h * d + 2 * H * n_kv * d + n_h * d * H + 3 * H * I)
    return dict(H=H, L=cfg.num_hidden_layers, n_h=n_h, n_kv=n_kv, d=d, V=cfg.vocab_size, body=body)


def rows_decoding(B: int, N: int, lengths: list[int] | None = None) -> list[int]:
    """Rows that produce a token at each position 0 .. max length − 1 (position 0: the prefill's token): B at every
    one of N positions, or, for a ragged batch, the rows whose length is above the position."""
    if lengths is None:
        return [B] * N
    if len(lengths) != B or min(lengths, default=1) < 1:
        raise ValueError(f"lengths: {B} rows of at least one new token each, got {len(lengths)} rows, "
                         f"shortest {min(lengths, default=None)}")
    ending = [0] * (max(lengths) + 1)  # rows whose last token is at each position
    for n in lengths:
        ending[n - 1] += 1
    active, out = B, []
    for pos in range(max(lengths)):
        out.append(active)
        active -= ending[pos]
    return out


def rollout_floor_s(s: dict, B: int, Lp: int, N: int, bw: float, rate: float,
                    lengths: list[int] | None = None) -> tuple[float, float]:
    """(prefill floor, decode floor) in seconds for B rows, prompt Lp, N new tokens each (or ``lengths``)."""
    attn = 4 * s["n_h"] * s["d"] * s["L"]
    prefill = B * Lp * (2 * s["body"] + attn * Lp / 2) + B * 2 * s["V"] * s["H"]
    decode = 0.0
    weights = 2 * (s["body"] + s["V"] * s["H"])
    for step, b in enumerate(rows_decoding(B, N, lengths)):
        if step == 0:  # the prefill's token
            continue
        c = Lp + step
        kv = s["L"] * 2 * b * s["n_kv"] * c * s["d"] * 2
        flops = b * (2 * s["body"] + 2 * s["V"] * s["H"] + attn * c)
        decode += max((weights + kv) / bw, flops / rate)
    return prefill / rate, decode


def train_flops(s: dict, B: int, Lp: int, N: int) -> float:
    """Forward + backward FLOPs of one pass over B sequences of Lp + N tokens (head on the N response tokens)."""
    L = Lp + N
    per_seq = L * 2 * s["body"] + 4 * s["n_h"] * s["d"] * s["L"] * L * L / 2 + N * 2 * s["V"] * s["H"]
    return 3 * B * per_seq


def rollout_flops(s: dict, B: int, Lp: int, N: int, lengths: list[int] | None = None) -> float:
    """FLOPs of a rollout: the prompts' prefill, then every token produced (N per row, or ``lengths``)."""
    attn = 4 * s["n_h"] * s["d"] * s["L"]
    total = B * Lp * (2 * s["body"] + attn * Lp / 2)
    for step, b in enumerate(rows_decoding(B, N, lengths)):
        total += b * (2 * s["body"] + 2 * s["V"] * s["H"] + attn * (Lp + step))
    return total


def measure_ceilings(device: torch.device) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and the bf16 matmul rate, on random data."""
    def timed(fn, reps):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    src = torch.randn(1 << 30, dtype=torch.bfloat16, device=device)  # 2 GiB
    dst = torch.empty_like(src)
    t_copy = timed(lambda: dst.copy_(src), 20)
    bw = 2 * src.numel() * 2 / t_copy
    del src, dst
    n = 8192
    a, b = torch.randn(n, n, dtype=torch.bfloat16, device=device), torch.randn(n, n, dtype=torch.bfloat16, device=device)
    t_mm = timed(lambda: a @ b, 20)
    return {"copy_bytes_per_s": bw, "bf16_flops_per_s": 2 * n ** 3 / t_mm}
