"""Triton kernels for the static-cache decode step: the same functions as ``decode_ops.py``, one launch each.

A decode step at batch 512 is memory-bound and made of small tensors (512 × hidden), so the eager
sequence of ~40 torch kernels per layer costs more in launches and round trips through memory than in
arithmetic. These kernels fuse what belongs together and keep the arithmetic (and its rounding points)
of the reference functions:

* ``add_rmsnorm``: residual add + RMSNorm in one pass over the row;
* ``silu_mul``: the gated MLP activation on the concatenated [gate | up] output;
* ``decode_attention``: rotary on q and k, the k/v write into the cache, and grouped-query attention
  (online softmax, flash-decoding style) of one token over only the row's live slots (its prompt's,
  stored once per distinct prompt, then its own generated ones): one program per (row, KV head) loads
  the cache once for all the query heads that share it, so the bytes read are the KV cache's live part,
  not the whole preallocated length; a small batch (a compacted long tail) splits each row's context
  over several programs and merges their softmax states in a second kernel (``attention_splits``);
* ``race_sample``: the exponential race over the vocabulary with the hash drawn in registers, plus the
  log-sum-exp for the log-prob, in one pass over the logits (no float32 copy, no cumulative sum); in
  base 2 with the hardware log2 on a GPU, so the same draw as the reference up to rounding.

Every launch reads the step counter from device memory, so a CUDA graph replays them unchanged.
Tests compare each kernel with its reference (on a CPU under ``TRITON_INTERPRET=1``:
tests/unit/test_triton_interpreted.py).
"""

from __future__ import annotations

import functools
import warnings

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from streamrft.engines import decode_ops as ref
from streamrft.engines.hf_fast import is_triton_failure

# kernels may read module globals only as constexpr values: the reference's hash constants
M32 = tl.constexpr(ref.M32)
MIX_MUL = tl.constexpr(ref.MIX_MUL)
VOCAB_MUL = tl.constexpr(ref.VOCAB_MUL)
WORD2_XOR = tl.constexpr(ref.WORD2_XOR)
STEP_ADD = tl.constexpr(ref.STEP_ADD)
SMALL_U = tl.constexpr(ref.SMALL_U)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _mix32_u32(x):
    x = x ^ (x >> 16)
    x = x * MIX_MUL
    x = x ^ (x >> 16)
    x = x * MIX_MUL
    return x ^ (x >> 16)


@triton.jit
def _mix32_i64(x):
    x = x ^ (x >> 16)
    x = (x * MIX_MUL) & M32
    x = x ^ (x >> 16)
    x = (x * MIX_MUL) & M32
    return x ^ (x >> 16)


@triton.jit
def _log2(x, FAST: tl.constexpr):
    """log2: the hardware approximation (lg2.approx, ~2^-22 relative error) on a GPU; the interpreter
    has no libdevice, so it takes the exact one."""
    if FAST:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def _race_partial_kernel(z_ptr, stride_z, inv_temp, seeds_ptr, step_ptr, need_ptr, best_ptr, idx_ptr, zbest_ptr, m_ptr,
                         s_ptr, V, span, BLOCK: tl.constexpr, FAST_MATH: tl.constexpr, HAS_NEED: tl.constexpr):
    """Program (row, split): the race and the log-sum-exp over the vocabulary entries split·span .. +span; none
    for a finished row (its token is not used)."""
    row = tl.program_id(0).to(tl.int64)  # 64-bit: row · width passes 2**31 in large prefills
    split = tl.program_id(1)
    seed = tl.load(seeds_ptr + row).to(tl.int64)
    step = tl.load(step_ptr).to(tl.int64)
    s = _mix32_i64((step + STEP_ADD) & M32)
    key = _mix32_i64((seed & M32) ^ _mix32_i64(((seed >> 32) & M32) ^ s)).to(tl.uint32)
    neg_inf = float("-inf")
    lane_best = tl.full([BLOCK], neg_inf, tl.float32)
    lane_idx = tl.zeros([BLOCK], dtype=tl.int32)
    lane_z = tl.zeros([BLOCK], dtype=tl.float32)
    lane_m = tl.full([BLOCK], neg_inf, tl.float32)
    lane_s = tl.zeros([BLOCK], dtype=tl.float32)
    offs0 = tl.arange(0, BLOCK)
    lo = split * span
    hi = tl.minimum(lo + span, V)
    if HAS_NEED:
        hi = tl.where(step < tl.load(need_ptr + row), hi, lo)  # finished: no entries (_race_reduce_kernel)
    # base 2 throughout: z2 = z·log2(e), E2 = E·log2(e); argmax(z2 - log2 E2) = argmax(z - ln E) (a constant
    # shift), and exp2/log2 are the GPU's fast special functions
    for v0 in range(lo, hi, BLOCK):
        offs = v0 + offs0
        valid = offs < hi
        z = tl.load(z_ptr + row * stride_z + offs, mask=valid, other=neg_inf).to(tl.float32) * (inv_temp * LOG2E)
        a = _mix32_u32(key ^ (offs.to(tl.uint32) * VOCAB_MUL))
        b = _mix32_u32(a ^ WORD2_XOR)
        u = a.to(tl.float32) * 2.3283064365386963e-10 + b.to(tl.float32) * 5.421010862427522e-20
        e = tl.where(u < SMALL_U, u * (1.0 + u * (0.5 + u * (1.0 / 3.0))) * LOG2E, -_log2(1.0 - u, FAST_MATH))
        live = z > neg_inf
        score = tl.where(live, z - _log2(e, FAST_MATH), neg_inf)
        take = score > lane_best
        lane_best = tl.where(take, score, lane_best)
        lane_idx = tl.where(take, offs, lane_idx)
        lane_z = tl.where(take, z, lane_z)
        # the running sum in one exp2 per entry (the race needs two log2 already; the special-function unit is
        # what bounds this kernel): d = 2^-|z - m| is the old sum's rescale when z is the new maximum and z's
        # own term otherwise (an empty lane's maximum counts as 0: no -inf - -inf). The same values as
        # rescaling and adding with two exp2
        grow = z > lane_m
        d = tl.exp2(-tl.abs(z - tl.where(lane_m > neg_inf, lane_m, 0.0)))
        lane_s = tl.where(live, tl.where(grow, lane_s * d + 1.0, lane_s + d), lane_s)
        lane_m = tl.maximum(lane_m, z)
    best = tl.max(lane_best, 0)
    idx = tl.min(tl.where(lane_best == best, lane_idx, V), 0)
    m = tl.max(lane_m, 0)
    m_safe = tl.where(m > neg_inf, m, 0.0)
    out = row * tl.num_programs(1) + split
    tl.store(best_ptr + out, best)
    tl.store(idx_ptr + out, idx)
    tl.store(zbest_ptr + out, tl.sum(tl.where((lane_idx == idx) & (lane_best == best), lane_z, 0.0), 0))
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, tl.sum(tl.where(lane_m > neg_inf, lane_s * tl.exp2(lane_m - m_safe), 0.0), 0))


@triton.jit
def _race_reduce_kernel(best_ptr, idx_ptr, zbest_ptr, m_ptr, s_ptr, tok_ptr, logp_ptr, V,
                        SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Program row: the winner over the splits (ties to the lowest index) and its log-prob."""
    row = tl.program_id(0).to(tl.int64)  # 64-bit: row · width passes 2**31 in large prefills
    offs = tl.arange(0, SPLITS_PAD)
    valid = offs < SPLITS
    at = row * SPLITS + offs
    neg_inf = float("-inf")
    best = tl.load(best_ptr + at, mask=valid, other=neg_inf)
    idx = tl.load(idx_ptr + at, mask=valid, other=V)
    m = tl.load(m_ptr + at, mask=valid, other=neg_inf)
    s = tl.load(s_ptr + at, mask=valid, other=0.0)
    top = tl.max(best, 0)
    win = tl.min(tl.where(best == top, idx, V), 0)
    z_win = tl.sum(tl.where((idx == win) & (best == top), tl.load(zbest_ptr + at, mask=valid, other=0.0), 0.0), 0)
    gm = tl.max(m, 0)
    gm = tl.where(gm > neg_inf, gm, 0.0)
    total = tl.sum(tl.where(m > neg_inf, s * tl.exp2(m - gm), 0.0), 0)
    drawn = total > 0  # no entry was looked at: a finished row (token 0, log-prob 0: neither is used)
    tl.store(tok_ptr + row, win.to(tl.int64))
    logp = (z_win - gm - tl.log2(tl.where(drawn, total, 1.0))) * LN2  # back to natural log
    tl.store(logp_ptr + row, tl.where(drawn, logp, 0.0))


def race_splits(batch: int, vocab: int, block: int = 1024, target_programs: int = 4096) -> tuple[int, int]:
    """(splits, span): how many programs share a row's vocabulary in ``race_sample``, each over ``span`` entries.
    From the batch's power-of-two bucket: the merge kernel's SPLITS is a compile-time constant, and a compacted
    decoder (hf_fast) samples at batch sizes that vary from chunk to chunk."""
    splits = max(1, min(triton.cdiv(target_programs, triton.next_power_of_2(batch)), triton.cdiv(vocab, block)))
    span = triton.cdiv(triton.cdiv(vocab, splits), block) * block
    return triton.cdiv(vocab, span), span


def race_sample(logits_BV: torch.Tensor, inv_temperature: float, seeds_B: torch.Tensor,
                step: torch.Tensor, block: int = 1024, target_programs: int = 4096,
                num_warps: int = 4, need_B: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``need_B`` (decode_ops.race_sample): a row with ``step >= need_B[row]`` is finished and skipped, its
    token 0. The vocabulary is split so that about ``target_programs`` programs share the rows (several per
    multiprocessor), then one small kernel merges the splits. On an H200 the race is compute-bound
    (two hashes, two log2 and, for the log-sum-exp, one exp2 per entry; two exp2 until v18): 320-400 µs at
    (512, 151936) with exact logs, 179-212 µs with the hardware log2 (decode_bench --tune; benchmarks/NOTES.md)."""
    B, V = logits_BV.shape
    logits_BV = logits_BV if logits_BV.stride(-1) == 1 else logits_BV.contiguous()
    splits, span = race_splits(B, V, block, target_programs)
    dev = logits_BV.device
    best, z_best, m, s = (torch.empty((B, splits), dtype=torch.float32, device=dev) for _ in range(4))
    idx = torch.empty((B, splits), dtype=torch.int32, device=dev)
    _race_partial_kernel[(B, splits)](logits_BV, logits_BV.stride(0), float(inv_temperature), seeds_B, step,
                                      step if need_B is None else need_B, best, idx, z_best, m, s, V, span,
                                      BLOCK=block, num_warps=num_warps, FAST_MATH=logits_BV.is_cuda,
                                      HAS_NEED=need_B is not None)
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    logp = torch.empty(B, dtype=torch.float32, device=dev)
    _race_reduce_kernel[(B,)](best, idx, z_best, m, s, tokens, logp, V, SPLITS=splits,
                              SPLITS_PAD=max(2, triton.next_power_of_2(splits)), num_warps=1)
    return tokens, logp


@triton.jit
def _add_rmsnorm_kernel(res_ptr, delta_ptr, w_ptr, res_out_ptr, h_out_ptr, H, eps,
                        HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # 64-bit: row · width passes 2**31 in large prefills
    offs = tl.arange(0, BLOCK)
    valid = offs < H
    r = tl.load(res_ptr + row * H + offs, mask=valid, other=0.0)
    dtype = r.dtype
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * H + offs, mask=valid, other=0.0)
        r = (r.to(tl.float32) + d.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * H + offs, r, mask=valid)
    x = r.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / H + eps)
    w = tl.load(w_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    h = (w * (x * rstd).to(dtype).to(tl.float32)).to(dtype)
    tl.store(h_out_ptr + row * H + offs, h, mask=valid)


def add_rmsnorm(res_BH: torch.Tensor, delta_BH: torch.Tensor | None, weight_H: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    B, H = res_BH.shape
    if not (res_BH.is_contiguous() and (delta_BH is None or delta_BH.is_contiguous())):
        raise ValueError("add_rmsnorm: rows must be contiguous")
    h = torch.empty_like(res_BH)
    res_out = res_BH if delta_BH is None else torch.empty_like(res_BH)
    _add_rmsnorm_kernel[(B,)](res_BH, res_BH if delta_BH is None else delta_BH, weight_H, res_out, h, H, float(eps),
                              HAS_DELTA=delta_BH is not None, BLOCK=triton.next_power_of_2(H),
                              num_warps=4 if H <= 2048 else 8)
    return res_out, h


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # 64-bit: row · width passes 2**31 in large prefills
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < I
    g = tl.load(gu_ptr + row * 2 * I + offs, mask=valid, other=0.0)
    u = tl.load(gu_ptr + row * 2 * I + I + offs, mask=valid, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * I + offs, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=valid)


def silu_mul(gate_up_BI2: torch.Tensor) -> torch.Tensor:
    B, I2 = gate_up_BI2.shape
    if not gate_up_BI2.is_contiguous():
        raise ValueError("silu_mul: rows must be contiguous")
    out = torch.empty((B, I2 // 2), dtype=gate_up_BI2.dtype, device=gate_up_BI2.device)
    block = 1024
    _silu_mul_kernel[(B, triton.cdiv(I2 // 2, block))](gate_up_BI2, out, I2 // 2, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _attend_block(q, kb, vb, live_n, m, l_sum, acc, sm_scale, PRECISION: tl.constexpr):
    """One block of cache slots into the online softmax (m, l_sum, acc) of the query heads ``q``."""
    s = tl.dot(q, tl.trans(kb), input_precision=PRECISION) * sm_scale
    s = tl.where(live_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), vb, input_precision=PRECISION)
    return m_new, l_sum, acc


@triton.jit
def _decode_attention_kernel(qkv_ptr, pk_ptr, pv_ptr, gk_ptr, gv_ptr, out_ptr, prompt_row_ptr, start_ptr, step_ptr,
                             need_ptr, pos_ptr, inv_freq_ptr, prompt_len, rope_scale, sm_scale,
                             stride_qkv, stride_pb, stride_ph, stride_ps, stride_gb, stride_gh, stride_gs,
                             N_HEADS: tl.constexpr, N_KV: tl.constexpr, GROUP: tl.constexpr,
                             GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                             PRECISION: tl.constexpr, HAS_NEED: tl.constexpr,
                             SPLITS: tl.constexpr, m_part_ptr, l_part_ptr, acc_part_ptr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    split = tl.program_id(2)  # SPLITS > 1: this program's share of each part's blocks (flash-decoding)
    half: tl.constexpr = D // 2
    step = tl.load(step_ptr).to(tl.int32)
    gen_slot = step - 1  # the fed token's slot in the row's generated cache
    start = tl.load(start_ptr + b).to(tl.int32)
    # a finished row (its token is not used) reads no cache: its output is the fed token's v
    prompt_end, gen_end = prompt_len, gen_slot
    if HAS_NEED:
        running = step < tl.load(need_ptr + b).to(tl.int32)
        prompt_end, gen_end = tl.where(running, prompt_len, 0), tl.where(running, gen_slot, 0)
    prompt_row = tl.load(prompt_row_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.float32)
    offs_d = tl.arange(0, D)
    partner = (offs_d + half) % D
    sign = tl.where(offs_d < half, -1.0, 1.0)
    freq = pos * tl.load(inv_freq_ptr + offs_d % half)
    cos = tl.cos(freq) * rope_scale
    sin = tl.sin(freq) * rope_scale
    offs_g = tl.arange(0, GROUP_PAD)
    live_g = offs_g < GROUP
    row = qkv_ptr + b * stride_qkv
    q_at = row + (h * GROUP + offs_g)[:, None] * D
    q = tl.load(q_at + offs_d[None, :], mask=live_g[:, None], other=0.0)
    dtype = q.dtype
    q_rot = tl.load(q_at + partner[None, :], mask=live_g[:, None], other=0.0).to(tl.float32) * sign[None, :]
    q = (q.to(tl.float32) * cos[None, :] + q_rot * sin[None, :]).to(dtype)
    k_at = row + (N_HEADS + h) * D
    k = tl.load(k_at + offs_d).to(tl.float32)
    k = (k * cos + tl.load(k_at + partner).to(tl.float32) * sign * sin).to(dtype)
    v = tl.load(row + (N_HEADS + N_KV + h) * D + offs_d)
    gen_off = b * stride_gb + h * stride_gh
    first = split == 0  # the first split writes the token's k, v and counts it; the others never read its slot
    tl.store(gk_ptr + gen_off + gen_slot * stride_gs + offs_d, k, mask=(offs_d < D) & first)
    tl.store(gv_ptr + gen_off + gen_slot * stride_gs + offs_d, v, mask=(offs_d < D) & first)
    # the current token from registers; then the prompt's live slots from its shared entry (the rows of a
    # group run side by side, so all but the first read it from L2), then the row's older generated slots
    # (the other splits keep the token's score as their first reference max, with nothing summed yet)
    m = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1) * sm_scale
    l_sum = tl.where(first, tl.full([GROUP_PAD], 1.0, tl.float32), 0.0)
    acc = tl.where(first, tl.zeros([GROUP_PAD, D], dtype=tl.float32) + v.to(tl.float32)[None, :], 0.0)
    offs_n0 = tl.arange(0, BLOCK_N)
    prompt_off = prompt_row * stride_pb + h * stride_ph
    # each split takes a contiguous share of each part's blocks; one split: the whole parts
    prompt_lo = (start // BLOCK_N) * BLOCK_N
    prompt_per = tl.cdiv(tl.cdiv(tl.maximum(prompt_end - prompt_lo, 0), BLOCK_N), SPLITS) * BLOCK_N
    prompt_hi = tl.minimum(prompt_lo + (split + 1) * prompt_per, prompt_end)
    prompt_lo += split * prompt_per
    gen_per = tl.cdiv(tl.cdiv(gen_end, BLOCK_N), SPLITS) * BLOCK_N
    gen_lo, gen_hi = split * gen_per, tl.minimum((split + 1) * gen_per, gen_end)
    for n0 in range(prompt_lo, prompt_hi, BLOCK_N):
        offs_n = n0 + offs_n0
        live_n = (offs_n >= start) & (offs_n < prompt_len)
        at = prompt_off + offs_n[:, None] * stride_ps + offs_d[None, :]
        kb = tl.load(pk_ptr + at, mask=live_n[:, None], other=0.0)
        vb = tl.load(pv_ptr + at, mask=live_n[:, None], other=0.0)
        m, l_sum, acc = _attend_block(q, kb, vb, live_n, m, l_sum, acc, sm_scale, PRECISION)
    for n0 in range(gen_lo, gen_hi, BLOCK_N):
        offs_n = n0 + offs_n0
        live_n = offs_n < gen_slot
        at = gen_off + offs_n[:, None] * stride_gs + offs_d[None, :]
        kb = tl.load(gk_ptr + at, mask=live_n[:, None], other=0.0)
        vb = tl.load(gv_ptr + at, mask=live_n[:, None], other=0.0)
        m, l_sum, acc = _attend_block(q, kb, vb, live_n, m, l_sum, acc, sm_scale, PRECISION)
    if SPLITS == 1:
        out = (acc / l_sum[:, None]).to(dtype)
        tl.store(out_ptr + b * (N_HEADS * D) + (h * GROUP + offs_g)[:, None] * D + offs_d[None, :], out,
                 mask=live_g[:, None])
    else:  # the split's softmax state, for _attention_merge_kernel
        part = (b * N_HEADS + h * GROUP + offs_g) * SPLITS + split
        tl.store(m_part_ptr + part, m, mask=live_g)
        tl.store(l_part_ptr + part, l_sum, mask=live_g)
        tl.store(acc_part_ptr + part[:, None] * D + offs_d[None, :], acc, mask=live_g[:, None])


@triton.jit
def _attention_merge_kernel(m_part_ptr, l_part_ptr, acc_part_ptr, out_ptr, SPLITS: tl.constexpr, D: tl.constexpr):
    """Program (row, query head): the splits' softmax states into the output (an empty split has l = 0, acc = 0:
    it adds nothing)."""
    r = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, D)
    m = tl.load(m_part_ptr + r * SPLITS + offs_s)
    w = tl.exp(m - tl.max(m, 0))
    acc = tl.load(acc_part_ptr + (r * SPLITS + offs_s)[:, None] * D + offs_d[None, :])
    total = tl.sum(tl.load(l_part_ptr + r * SPLITS + offs_s) * w, 0)
    tl.store(out_ptr + r * D + offs_d, (tl.sum(acc * w[:, None], 0) / total).to(out_ptr.dtype.element_ty))


def attention_launch(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, warps, pipeline stages) of the decode attention, from decode_bench.py on an H200 (B = 512, GRPO
    groups of 8 sharing a prompt entry, context 512; benchmarks/NOTES.md v16): head_dim 64 (0.5B) 32-slot blocks,
    2 warps, 3 stages — the whole decode 2.53 → 2.35 ms/step against v15's 64/2/2; head_dim 128 (1.5B) 64-slot
    blocks, 4 warps, 2 stages (the fastest of 14 settings there, 64.6 µs/layer)."""
    return (32, 2, 3) if head_dim <= 64 else (64, 4, 2)


MAX_SPLITS = 16  # flash-decoding splits of one row's context at most (attention_splits)
_SPLITS_FAILED: list[str] = []  # the split kernels' failure on this machine, once: the whole-context kernel from then on


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The device's streaming multiprocessors; 1 off a GPU (Triton's interpreter: one split unless asked for)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def attention_splits(batch: int, n_kv: int, multiprocessor_count: int) -> int:
    """How many programs share one (row, kv head)'s context: 1 while the batch's programs fill the GPU twice over
    (B = 512 at 0.5B: the fixed workload's kernel), more for a compacted long-tailed chunk, whose few rows would
    each be walked by one program over thousands of slots while most multiprocessors idle (benchmarks/NOTES.md
    v19); a power of two up to MAX_SPLITS, fixed per captured graph (its batch size)."""
    programs, target = batch * n_kv, 2 * multiprocessor_count
    if programs >= target:
        return 1
    return min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(target, programs)))


def decode_attention(qkv_BX: torch.Tensor, prompt_k: torch.Tensor, prompt_v: torch.Tensor, gen_k: torch.Tensor,
                     gen_v: torch.Tensor, prompt_row_B: torch.Tensor, start_B: torch.Tensor, step: torch.Tensor,
                     pos_B: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float, sm_scale: float, n_heads: int,
                     n_kv: int, block_n: int = 0, num_warps: int = 0, num_stages: int = 0,
                     need_B: torch.Tensor | None = None, splits: int = 0) -> torch.Tensor:
    """decode_ops.decode_attention; a row with ``step >= need_B[row]`` is finished: no cache read, its output
    unspecified. Launch settings (0: ``attention_launch``'s for the head size). ``splits`` (0: ``attention_splits``;
    a power of two): programs
    per (row, kv head), each over a share of the context, merged by a second kernel. A split kernel that fails
    (compiling, launching) warns once and the whole-context kernel runs from then on in this process."""
    B = qkv_BX.shape[0]
    if splits == 0:
        splits = 1 if _SPLITS_FAILED else attention_splits(B, n_kv, multiprocessors(qkv_BX.device))
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"decode_attention: splits={splits} must be a power of two")
    if splits > 1:
        try:
            return _decode_attention(qkv_BX, prompt_k, prompt_v, gen_k, gen_v, prompt_row_B, start_B, step, pos_B,
                                     inv_freq, rope_scale, sm_scale, n_heads, n_kv, block_n, num_warps, num_stages,
                                     need_B, splits)
        except Exception as exc:  # noqa: BLE001 - Triton's own errors only; anything else is re-raised
            if not is_triton_failure(exc):
                raise
            _SPLITS_FAILED.append(f"{type(exc).__name__}: {exc}")
            warnings.warn(f"decode attention: the split-context kernels failed ({_SPLITS_FAILED[0][:300]}); "
                          "decoding with one program per row and kv head from now on")
    return _decode_attention(qkv_BX, prompt_k, prompt_v, gen_k, gen_v, prompt_row_B, start_B, step, pos_B, inv_freq,
                             rope_scale, sm_scale, n_heads, n_kv, block_n, num_warps, num_stages, need_B, 1)


def _decode_attention(qkv_BX, prompt_k, prompt_v, gen_k, gen_v, prompt_row_B, start_B, step, pos_B, inv_freq,
                      rope_scale, sm_scale, n_heads, n_kv, block_n, num_warps, num_stages, need_B, splits) -> torch.Tensor:
    B, d = qkv_BX.shape[0], gen_k.shape[-1]
    default_block_n, default_warps, default_stages = attention_launch(d)
    block_n, num_warps, num_stages = block_n or default_block_n, num_warps or default_warps, num_stages or default_stages
    for name, t in (("prompt_k", prompt_k), ("prompt_v", prompt_v), ("gen_k", gen_k), ("gen_v", gen_v)):
        if t.stride(-1) != 1:
            raise ValueError(f"decode_attention: {name} must be contiguous in the head dimension")
    if prompt_k.stride() != prompt_v.stride() or gen_k.stride() != gen_v.stride():
        raise ValueError("decode_attention: k and v caches of a part must have the same strides")
    group = n_heads // n_kv
    out = torch.empty((B, n_heads * d), dtype=qkv_BX.dtype, device=qkv_BX.device)
    precision = "ieee" if qkv_BX.dtype == torch.float32 else None  # float32 models: no TF32 rounding
    parts = [out] * 3  # one split: never touched
    if splits > 1:
        parts = [torch.empty((B, n_heads, splits, *shape), dtype=torch.float32, device=qkv_BX.device)
                 for shape in ((), (), (d,))]
    _decode_attention_kernel[(B, n_kv, splits)](
        qkv_BX, prompt_k, prompt_v, gen_k, gen_v, out, prompt_row_B, start_B, step,
        step if need_B is None else need_B, pos_B, inv_freq,
        int(prompt_k.shape[2]), float(rope_scale), float(sm_scale), qkv_BX.stride(0),
        prompt_k.stride(0), prompt_k.stride(1), prompt_k.stride(2), gen_k.stride(0), gen_k.stride(1),
        gen_k.stride(2), N_HEADS=n_heads, N_KV=n_kv, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        D=d, BLOCK_N=block_n, PRECISION=precision, HAS_NEED=need_B is not None,
        SPLITS=splits, m_part_ptr=parts[0], l_part_ptr=parts[1], acc_part_ptr=parts[2],
        num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        _attention_merge_kernel[(B * n_heads,)](*parts, out, SPLITS=splits, D=d, num_warps=1)
    return out


__all__ = ["add_rmsnorm", "attention_launch", "attention_splits", "decode_attention", "race_sample", "race_splits",
           "silu_mul"]
