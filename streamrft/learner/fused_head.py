"""The LM head's per-token log-prob and entropy, forward and backward, one (chunk, V) block at a time.

For rows h_n (N, H) of final hidden states, head weight W (V, H), optional bias b, temperature T and target
ids y_n, with z = (h W^T + b) / T (banned ids set to a -inf-like value) and p = softmax(z):

    logp_n = z_{n, y_n} - lse_n,        lse_n = logsumexp_v z_{n, v}
    H_n    = -sum_v p_{n, v} log p_{n, v}

Backward, for upstream gradients g_logp and g_H (the derivation, per row, with log p_v = z_v - lse):

    d logp / d z_j = [j = y] - p_j
    d H / d z_j    = -sum_v (d p_v / d z_j)(log p_v + 1) = -sum_v p_v ([v = j] - p_j)(log p_v + 1)
                   = -p_j (log p_j + 1) + p_j (1 - H) = -p_j (log p_j + H)

so, with the 1/T of z's definition, the gradient of the head's raw output is

    dZ = (1/T) [ g_logp ([j = y] - p) - g_H p (log p + H) ]

then dh = dZ W, dW = dZ^T h, db = sum_n dZ. Banned ids have p = 0 and get no gradient (their logit is a
constant fill, as the checkpoint kernel's ``index_fill`` makes it), even when one is a target. (This backward
has no g_H * log p product, which overflows at banned ids; the checkpoint kernel masks its p = 0 entries.)

Why a custom autograd Function instead of checkpointing the plain computation (``logprobs.py``'s
``checkpoint`` kernel): autograd recomputes the whole forward graph of each chunk in backward (cast, scale,
log-softmax, gather, exp, product) and then walks it with several (chunk, V) float32 temporaries; here the
forward keeps no graph (only h, targets and two floats per row) and the backward recomputes z with one
matmul, then forms dZ in one elementwise pass (one compiled kernel on CUDA with ``train.compile_head``).
Peak memory: about two (chunk, V) float32 blocks eagerly (benchmarks/head_bench.py measures 2.1 on CPU,
against 5.1 for the checkpoint kernel); compiled, the backward holds the head output and dZ, two blocks
in the weight's dtype.

Precision: matmuls run in the weight's dtype (float32 accumulation inside each GEMM where torch gives it);
the elementwise part is float32. dW accumulates over chunks in the weight's dtype with ``addmm_`` (beta = 1:
one rounding per chunk, as autograd's per-chunk gradient sum does today), db in float32.

Tied embeddings and FSDP2 need nothing special: ``head.weight`` is an input of the Function, so its gradient
goes back through autograd, which adds it to the embedding's own (tied) and fires FSDP2's hooks.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from streamrft.config.train import compile_head_enabled
from streamrft.learner.compiling import CompiledOrEager

_FILL = torch.finfo(torch.float32).min  # the banned ids' scaled logit, as logprobs.py's checkpoint kernel


def _scaled_logits(h_nH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None, inv_temperature: float,
                   banned_V: torch.Tensor | None) -> torch.Tensor:
    """float32 z = (h W^T + b) / T with banned ids filled. The head matmul is done here, not by the caller, so
    that its output is owned by this frame and the scaling can run in place (``.float()`` of a float32
    tensor is the tensor itself): one float32 (chunk, V) block, not two."""
    z_raw = F.linear(h_nH, weight_VH, bias_V)
    z_NV = z_raw.float()
    del z_raw  # a bf16 output is dropped once cast
    z_NV.mul_(inv_temperature)
    if banned_V is not None:  # a (V,) bool mask, not an index fill: pointwise, so it fuses when compiled
        z_NV.masked_fill_(banned_V, _FILL)
    return z_NV


def _log_softmax_(z_NV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p, lse) with log p computed in place as (z - max) - log sum exp(z - max): the arithmetic of
    ``torch.log_softmax`` (so values agree with the checkpoint kernel to ~1 ulp), at one extra block."""
    max_N1 = z_NV.amax(dim=-1, keepdim=True)
    logp_NV = z_NV.sub_(max_N1)
    logsum_N1 = logp_NV.exp().sum(-1, keepdim=True).log_()
    logp_NV.sub_(logsum_N1)
    return logp_NV, (max_N1 + logsum_N1).squeeze(-1)


def chunk_stats(h_nH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None, target_N: torch.Tensor,
                inv_temperature: float, banned_V: torch.Tensor | None, with_entropy: bool):
    """(logp_N, lse_N, entropy_N | None) of one chunk of rows. Eagerly at most two float32 (chunk, V) blocks."""
    logp_NV, lse_N = _log_softmax_(_scaled_logits(h_nH, weight_VH, bias_V, inv_temperature, banned_V))
    logp_N = logp_NV.gather(-1, target_N.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp_N, lse_N, None
    # banned ids: p = 0 and log p = fill - lse is finite, so their term is exactly 0
    entropy_N = -(logp_NV.exp().mul_(logp_NV)).sum(-1)
    return logp_N, lse_N, entropy_N


def chunk_grad_logits(h_nH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None, target_N: torch.Tensor,
                      lse_N: torch.Tensor, entropy_N: torch.Tensor | None, g_logp_N: torch.Tensor | None,
                      g_entropy_N: torch.Tensor | None, inv_temperature: float, banned_V: torch.Tensor | None,
                      ) -> torch.Tensor:
    """dZ (the gradient of the raw head output, module docstring) of one chunk, in the weight's dtype.

    Two spellings of one formula. Eagerly, in-place ops keep the peak at two float32 (chunk, V) blocks
    (log p, then p which becomes dZ) and the one-hot term is an indexed update of N values. Under torch.compile
    everything is pointwise (the one-hot as ``column == target``), so inductor emits a single kernel
    that reads the head output and writes dZ in the weight's dtype, with no float32 block at all."""
    logp_NV = _scaled_logits(h_nH, weight_VH, bias_V, inv_temperature, banned_V).sub_(lse_N.unsqueeze(-1))
    if g_logp_N is None:
        g_logp_N = torch.zeros_like(lse_N)
    g_logp_N1 = g_logp_N.unsqueeze(-1)
    if torch.compiler.is_compiling():
        factor_NV = g_logp_N1 if g_entropy_N is None else (
            g_logp_N1 + g_entropy_N.unsqueeze(-1) * (logp_NV + entropy_N.unsqueeze(-1)))
        column_1V = torch.arange(logp_NV.shape[-1], device=logp_NV.device).unsqueeze(0)
        dz_NV = torch.where(column_1V == target_N.unsqueeze(-1), g_logp_N1, 0.0) - logp_NV.exp() * factor_NV
        if banned_V is not None:
            dz_NV = dz_NV.masked_fill(banned_V, 0.0)
        return (dz_NV * inv_temperature).to(weight_VH.dtype)
    p_NV = logp_NV.exp()
    if g_entropy_N is not None:  # the factor multiplying p: g_logp + g_H (log p + H), in log p's storage
        factor_NV = logp_NV.add_(entropy_N.unsqueeze(-1)).mul_(g_entropy_N.unsqueeze(-1)).add_(g_logp_N1)
        dz_NV = p_NV.mul_(factor_NV).neg_()
    else:
        dz_NV = p_NV.mul_(g_logp_N1).neg_()
    del logp_NV
    # + g_logp [j = y]: one element per row, as an index_put without accumulation (deterministic on CUDA
    # under train.deterministic, where scatter_add_ may refuse to run)
    rows_N = torch.arange(target_N.shape[0], device=target_N.device)
    dz_NV.index_put_((rows_N, target_N), dz_NV[rows_N, target_N] + g_logp_N)
    if banned_V is not None:  # a constant fill has no gradient, target or not
        dz_NV.masked_fill_(banned_V, 0.0)
    return dz_NV.mul_(inv_temperature).to(weight_VH.dtype)


# compiled at their first call; a failed compile warns once and runs eagerly (learner/compiling.py)
_ELEMENTWISE = {name: CompiledOrEager(fn, "train.compile_head", "computing the fused LM head's elementwise part",
                                      specialize_floats=True, dynamic=True)
                for name, fn in (("stats", chunk_stats), ("grad", chunk_grad_logits))}


def _elementwise(name: str, device: torch.device, compile_head: bool):
    """``chunk_stats`` or ``chunk_grad_logits``: under ``torch.compile`` on CUDA when asked; if compiling
    fails (no working Triton or C compiler), one warning and eager from then on (same values, slower). A
    failure of either turns both eager: the same compiler builds them."""
    if not compile_head_enabled(compile_head, device.type) or any(c.failed for c in _ELEMENTWISE.values()):
        return {"stats": chunk_stats, "grad": chunk_grad_logits}[name]
    return _ELEMENTWISE[name]


# torch.profiler range names around the Function's forward and backward: benchmarks/learner_profile.py tags the
# kernels launched inside them as the LM head's (its Inductor kernels carry generic triton_* names)
PROFILE_RANGE = "streamrft.lm_head"


def _profiled(name: str):
    """Run the function inside ``record_function(name)``, a fresh range per call (thread-safe: backward runs on
    autograd's device thread); a few microseconds when no profiler is active, twice per microbatch."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return inner
    return wrap


class FusedHeadLogprob(torch.autograd.Function):
    """(logp_N, entropy_N) float32 for rows ``h_NH`` and targets ``target_N``; entropy_N is zeros (no
    gradient) when ``with_entropy`` is false. See the module docstring."""

    @staticmethod
    @_profiled(PROFILE_RANGE + ".forward")
    def forward(ctx, h_NH, weight_VH, bias_V, target_N, banned_ids, inv_temperature: float, with_entropy: bool,
                chunk_size: int, compile_head: bool):
        N = h_NH.shape[0]
        banned_V = None
        if banned_ids is not None:
            banned_V = torch.zeros(weight_VH.shape[0], dtype=torch.bool, device=h_NH.device)
            banned_V[banned_ids] = True
        stats = _elementwise("stats", h_NH.device, compile_head)
        logp_N = h_NH.new_empty(N, dtype=torch.float32)
        lse_N = h_NH.new_empty(N, dtype=torch.float32)
        entropy_N = h_NH.new_zeros(N, dtype=torch.float32)
        for s in range(0, N, chunk_size):
            logp_n, lse_n, ent_n = stats(h_NH[s:s + chunk_size], weight_VH, bias_V, target_N[s:s + chunk_size],
                                         inv_temperature, banned_V, with_entropy)
            logp_N[s:s + chunk_size] = logp_n
            lse_N[s:s + chunk_size] = lse_n
            if with_entropy:
                entropy_N[s:s + chunk_size] = ent_n
        ctx.save_for_backward(h_NH, weight_VH, bias_V, target_N, banned_V, lse_N, entropy_N)
        ctx.inv_temperature, ctx.with_entropy, ctx.chunk_size, ctx.compile_head = (
            inv_temperature, with_entropy, chunk_size, compile_head)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy_N)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no (N,) zeros pass
        return logp_N, entropy_N

    @staticmethod
    @_profiled(PROFILE_RANGE + ".backward")
    def backward(ctx, g_logp_N, g_entropy_N):
        h_NH, weight_VH, bias_V, target_N, banned_V, lse_N, entropy_N = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if not ctx.with_entropy:
            g_entropy_N = None
        grad = _elementwise("grad", h_NH.device, ctx.compile_head)
        dh_NH = torch.zeros_like(h_NH) if need_h else None
        dW_VH = None  # the first chunk's product, then addmm_ (no zero-fill pass over V x H)
        db_V = torch.zeros(weight_VH.shape[0], dtype=torch.float32, device=h_NH.device) if need_b else None
        c = ctx.chunk_size
        for s in range(0, h_NH.shape[0], c):
            h_nH = h_NH[s:s + c]
            dz_nV = grad(h_nH, weight_VH, bias_V, target_N[s:s + c], lse_N[s:s + c],
                         None if g_entropy_N is None else entropy_N[s:s + c],
                         None if g_logp_N is None else g_logp_N[s:s + c],
                         None if g_entropy_N is None else g_entropy_N[s:s + c], ctx.inv_temperature, banned_V)
            if need_h:
                torch.mm(dz_nV, weight_VH, out=dh_NH[s:s + c])
            if need_w:
                dW_VH = torch.mm(dz_nV.t(), h_nH) if dW_VH is None else dW_VH.addmm_(dz_nV.t(), h_nH)
            if need_b:
                db_V += dz_nV.float().sum(0)
            del dz_nV
        if need_w and dW_VH is None:  # no rows
            dW_VH = torch.zeros_like(weight_VH)
        if need_b:
            db_V = db_V.to(bias_V.dtype)
        return dh_NH, dW_VH, db_V, None, None, None, None, None, None


def fused_logp_entropy(h_NH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None,
                       target_N: torch.Tensor, inv_temperature: float, with_entropy: bool, chunk_size: int,
                       banned_ids: torch.Tensor | None = None, compile_head: bool = False,
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp_N, entropy_N | None) float32, differentiable in h, weight and bias (module docstring)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be > 0")
    logp_N, entropy_N = FusedHeadLogprob.apply(h_NH, weight_VH, bias_V, target_N, banned_ids, inv_temperature,
                                               with_entropy, chunk_size, compile_head)
    return logp_N, entropy_N if with_entropy else None
