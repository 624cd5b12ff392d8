"""The static-cache decode path of the hf engine (``engine.static_cache``, optionally ``engine.cuda_graphs``).

The eager path (``hf.py``) grows a ``DynamicCache``, copies every token to the host and draws one
random number per row from a ``torch.Generator`` at every step: fine on CPU, but on a GPU each decode
step then costs hundreds of small launches and a host sync. Here, for a chunk of B requests:

* the KV cache is preallocated once, in two parts per layer: the prompts, left-padded, once per distinct
  prompt (``prompt_k, prompt_v: (U, n_kv, L_prompt, head_dim)``: the samples of a GRPO group share one
  entry, so prefill runs U prompts, not B, and decode reads each prompt's slots from DRAM about once), and
  each row's generated tokens (``gen_k, gen_v: (B, n_kv, N_new - 1, head_dim)``); row b's live slots are
  its prompt's ``start_B[b] .. L_prompt - 1`` and its own ``0 .. step - 1``;
* prefill and decode run on the model's weights with the q/k/v and gate/up projections concatenated
  into one GEMM each, and the fused operations of ``decode_ops`` (torch) or ``triton_decode`` (Triton
  kernels, ``engine.decode_kernels``): residual add + RMSNorm and the SiLU gate everywhere; in prefill,
  SDPA over the padded prompts, which fills the cache; in decode, rotary + cache write + grouped-query
  attention over the live slots only, and sampling by an exponential race with a counter-based hash of
  (row seed, step, token), so a row's draw depends only on its own seed and step, never on its batch;
* one decode step (forward, sampling, bookkeeping) has fixed shapes and no host syncs, so with
  ``engine.cuda_graphs`` it is captured once per chunk in a CUDA graph and replayed;
* the host reads the per-row first stop position only every ``engine.sync_every`` steps; finished
  rows keep their place in the step's shapes until the whole chunk is done (their tokens are cut off
  afterwards), but the device knows them (``need_B``: a row's limit, or up to its first stop token) and
  the Triton kernels skip their attention over the cache and their draw, so a long-tailed batch's late
  steps, mostly finished rows, cost the GEMMs and little else.

Supported: Llama/Qwen2-style decoders (``model.layers[i].self_attn.{q,k,v,o}_proj``, RMSNorm, SiLU-gated
MLP, rotary embedding, no sliding window). The same seed gives the same tokens within this path (and
the same kernels); the random stream differs from the eager path's.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import os
import time
import warnings
from collections import deque
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, AsyncIterator

import torch
import torch.nn.functional as F

from streamrft.engines import decode_ops
from streamrft.engines.decode_ops import rope_cos_sin, rotate_half
from streamrft.engines.base import GeneratedSample, GenerationRequest
from streamrft.engines.chunk_memory import DecoderShape, step_bytes
from streamrft.engines.sampling import process_logits

if TYPE_CHECKING:
    from streamrft.engines.hf import HFEngine

_SUPPORTED = ("qwen2", "llama", "mistral")


def check_static_support(module: torch.nn.Module) -> None:
    """ValueError when ``module`` is not a decoder this path can run."""
    config = getattr(module, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in _SUPPORTED:
        raise ValueError(f"engine.static_cache=true supports model types {_SUPPORTED}, got {kind!r}; "
                         "set engine.static_cache=false for this model")
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"engine.static_cache=true supports SiLU-gated MLPs, got hidden_act={config.hidden_act!r}; "
                         "set engine.static_cache=false for this model")
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise ValueError("engine.static_cache=true does not support sliding-window attention "
                         f"(sliding_window={config.sliding_window}); set engine.static_cache=false")


def is_triton_failure(exc: BaseException) -> bool:
    """An error raised by Triton itself (compiling or launching a kernel), or its import failing."""
    return type(exc).__module__.split(".")[0] == "triton" or isinstance(exc, ImportError)


def decode_kernels(kind: str, device: torch.device) -> ModuleType:
    """The module of fused decode operations for ``engine.decode_kernels`` on ``device``.

    ``auto``: Triton kernels on CUDA when the ``triton`` package is installed, else the torch functions.
    ``triton`` on a CPU runs only under Triton's interpreter (``TRITON_INTERPRET=1``, for tests)."""
    if kind not in ("auto", "torch", "triton"):
        raise ValueError(f"engine.decode_kernels={kind!r}: use auto, torch or triton")
    has_triton = importlib.util.find_spec("triton") is not None
    if kind == "torch" or (kind == "auto" and not (device.type == "cuda" and has_triton)):
        return decode_ops
    if not has_triton:
        raise ValueError("engine.decode_kernels=triton needs the triton package; install it or set "
                         "engine.decode_kernels=auto")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"engine.decode_kernels=triton needs a CUDA device, got {device}; "
                         "set engine.decode_kernels=auto (or TRITON_INTERPRET=1 to test the kernels on a CPU)")
    from streamrft.engines import triton_decode

    return triton_decode


@dataclass
class _Parts:
    embed: torch.nn.Module
    layers: list
    norm: torch.nn.Module
    rotary: torch.nn.Module
    head: torch.nn.Module
    n_heads: int
    n_kv: int
    head_dim: int


def _parts(module: torch.nn.Module) -> _Parts:
    decoder = module.get_decoder()
    cfg = module.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return _Parts(decoder.embed_tokens, list(decoder.layers), decoder.norm, decoder.rotary_emb,
                  module.get_output_embeddings(), cfg.num_attention_heads, cfg.num_key_value_heads, head_dim)


def decoder_shape(module: torch.nn.Module) -> DecoderShape:
    """The sizes a static-cache chunk's memory depends on (engines/chunk_memory.py)."""
    p = _parts(module)
    hidden = p.embed.weight.shape[1]
    down = p.layers[0].mlp.down_proj
    intermediate = getattr(down, "base_layer", down).in_features  # a peft LoRA layer wraps the linear
    return DecoderShape(len(p.layers), p.n_kv, p.head_dim, p.head.weight.shape[0], p.embed.weight.element_size(),
                        hidden, intermediate)


@dataclass
class _LayerWeights:
    """One decoder layer's weights as a decode step uses them: q/k/v and gate/up concatenated."""

    ln1: torch.Tensor
    ln1_eps: float
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    ln2: torch.Tensor
    ln2_eps: float
    gate_up_w: torch.Tensor
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None


def _linear_weights(lin: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) a linear layer applies; a peft LoRA layer (``model.lora_rank``, injected in place)
    applies its base weight plus ``scaling · B A`` of each active adapter, merged here."""
    base = getattr(lin, "base_layer", None)
    if base is None:
        return lin.weight, lin.bias
    weight = base.weight
    if not getattr(lin, "disable_adapters", False):
        for name in getattr(lin, "active_adapters", ()):
            if name in getattr(lin, "lora_A", {}):
                weight = weight + lin.get_delta_weight(name).to(weight.dtype)
    return weight, base.bias


def _concat(*linears: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One (weight, bias) for several linear layers of the same input, stacked along the output."""
    parts = [_linear_weights(lin) for lin in linears]
    weight = torch.cat([w for w, _ in parts])
    if all(b is None for _, b in parts):
        return weight, None
    return weight, torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in parts])


def _layer_weights(layer: torch.nn.Module) -> _LayerWeights:
    """Concatenated copies (one GEMM for q|k|v, one for gate|up); taken per chunk, after any weight push."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv_w, qkv_b = _concat(attn.q_proj, attn.k_proj, attn.v_proj)
    gate_up_w, gate_up_b = _concat(mlp.gate_proj, mlp.up_proj)
    o_w, o_b = _linear_weights(attn.o_proj)
    down_w, down_b = _linear_weights(mlp.down_proj)
    return _LayerWeights(layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon),
                         qkv_w, qkv_b, o_w, o_b,
                         layer.post_attention_layernorm.weight, float(layer.post_attention_layernorm.variance_epsilon),
                         gate_up_w, gate_up_b, down_w, down_b)


class StaticDecoder:
    """Decode state of one chunk: static KV cache, masks, output buffers (see the module docstring)."""

    def __init__(self, module, prompts: list[list[int]], seeds: list[int], n_new: int, pad_id: int,
                 stop_ids: list[int], temperature: float, first_temperature: float, top_k: int, top_p: float,
                 device: torch.device, ops: ModuleType = decode_ops, limits: list[int] | None = None):
        """``limits``: each row's own maximum of new tokens (``n_new``, the largest, when None)."""
        self.p = _parts(module)
        self.ops = ops
        self.w = [_layer_weights(layer) for layer in self.p.layers]
        self.sm_scale = float(self.p.layers[0].self_attn.scaling)
        self.temperature, self.first_temperature = temperature, first_temperature
        self.top_k, self.top_p = top_k, top_p
        # the samples of a GRPO group share their prompt: each distinct prompt is prefilled once and its
        # cache slots are stored once (row b reads entry prompt_row_B[b]); only generated slots are per row
        entry_of: dict[tuple[int, ...], int] = {}
        prompt_row = [entry_of.setdefault(tuple(p), len(entry_of)) for p in prompts]
        distinct = list(entry_of)
        B, U, Lp = len(prompts), len(distinct), max(len(p) for p in prompts)
        self.B, self.U, self.Lp, self.n_new = B, U, Lp, n_new
        dtype = self.p.embed.weight.dtype
        self.inv_freq = self.p.rotary.inv_freq.to(device=device, dtype=torch.float32)
        self.rope_scale = float(getattr(self.p.rotary, "attention_scaling", 1.0))
        ids_UL = torch.full((U, Lp), pad_id, dtype=torch.long)
        real_UL = torch.zeros((U, Lp), dtype=torch.bool)
        for i, p in enumerate(distinct):
            ids_UL[i, Lp - len(p):] = torch.tensor(p, dtype=torch.long)
            real_UL[i, Lp - len(p):] = True
        self.ids_UL, self.real_UL = ids_UL.to(device), real_UL.to(device)
        self.pos_UL = (self.real_UL.long().cumsum(1) - 1).clamp(min=0)
        self.prompt_row_B = torch.tensor(prompt_row, dtype=torch.int64, device=device)
        prompt_shape = (U, self.p.n_kv, Lp, self.p.head_dim)
        # the token fed at decode step s (token s - 1) goes to generated slot s - 1; the last token is never fed
        gen_shape = (B, self.p.n_kv, max(1, n_new - 1), self.p.head_dim)
        self.prompt_k = [torch.zeros(prompt_shape, dtype=dtype, device=device) for _ in self.p.layers]
        self.prompt_v = [torch.zeros(prompt_shape, dtype=dtype, device=device) for _ in self.p.layers]
        self.gen_k = [torch.zeros(gen_shape, dtype=dtype, device=device) for _ in self.p.layers]
        self.gen_v = [torch.zeros(gen_shape, dtype=dtype, device=device) for _ in self.p.layers]
        self.start_B = torch.tensor([Lp - len(p) for p in prompts], dtype=torch.int64, device=device)
        self.seeds_B = torch.tensor(seeds, dtype=torch.int64, device=device)
        self.stop_K = torch.tensor(sorted(stop_ids) or [-1], dtype=torch.int64, device=device)
        self.tokens_BN = torch.zeros((B, n_new), dtype=torch.int64, device=device)
        self.logp_BN = torch.zeros((B, n_new), dtype=torch.float32, device=device)
        self.first_stop_B = torch.full((B,), n_new, dtype=torch.int64, device=device)
        # tokens each row needs: its limit, or up to its first stop token. A row whose count is reached is
        # finished: the kernels skip its cache read and its draw (a long-tailed batch's late steps are mostly
        # finished rows), while the row keeps its place in the step's fixed shapes
        limits = limits or [n_new] * B
        if len(limits) != B or not all(1 <= n <= n_new for n in limits):
            raise ValueError(f"StaticDecoder: {B} row limits in 1..{n_new} expected, got {limits}")
        self.limit_B = torch.tensor(limits, dtype=torch.int64, device=device)
        self.need_B = self.limit_B.clone()
        self.tok_B = torch.zeros((B,), dtype=torch.int64, device=device)
        self.last_prompt_pos_B = self.pos_UL[:, -1].index_select(0, self.prompt_row_B)
        self.pos_B = self.last_prompt_pos_B.clone()
        self.step_1 = torch.zeros((1,), dtype=torch.int64, device=device)  # index of the next sampled token
        self.graph: torch.cuda.CUDAGraph | None = None

    # ---- forward ---------------------------------------------------------------------------------
    def prefill(self) -> None:
        """Run the distinct prompts on the decode weights and ops, fill the prompt cache, sample token 0
        of every row (the rows of a prompt draw from its logits with their own seeds).

        Attention is SDPA over the left-padded prompts (a pad query sees itself only, so no row is NaN);
        rotary embedding is applied as the model's own (cos/sin rounded to the model dtype)."""
        ops, p = self.ops, self.p
        U, Lp, d = self.U, self.Lp, p.head_dim
        dev = self.ids_UL.device
        causal_LL = torch.ones((Lp, Lp), dtype=torch.bool, device=dev).tril()
        eye_LL = torch.eye(Lp, dtype=torch.bool, device=dev)
        mask_U1LL = ((causal_LL & self.real_UL[:, None, :]) | eye_LL).unsqueeze(1)
        group = p.n_heads // p.n_kv
        # rotary from a device copy of inv_freq (the module's buffer may sit on the CPU after an offload)
        cos, sin = (t.to(p.embed.weight.dtype) for t in rope_cos_sin(self.pos_UL, self.inv_freq, self.rope_scale))
        res_TH, delta_TH = F.embedding(self.ids_UL, p.embed.weight).reshape(U * Lp, -1), None
        q_end, k_end = p.n_heads * d, (p.n_heads + p.n_kv) * d
        for i, w in enumerate(self.w):
            res_TH, h_TH = ops.add_rmsnorm(res_TH, delta_TH, w.ln1, w.ln1_eps)
            qkv_ULX = F.linear(h_TH, w.qkv_w, w.qkv_b).view(U, Lp, -1)
            q = qkv_ULX[..., :q_end].reshape(U, Lp, p.n_heads, d).transpose(1, 2)
            k = qkv_ULX[..., q_end:k_end].reshape(U, Lp, p.n_kv, d).transpose(1, 2)
            v = qkv_ULX[..., k_end:].reshape(U, Lp, p.n_kv, d).transpose(1, 2)
            q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
            self.prompt_k[i].copy_(k)
            self.prompt_v[i].copy_(v)
            k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            o = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask_U1LL, scale=self.sm_scale)
            res_TH, delta_TH = self._after_attention(res_TH, o.transpose(1, 2).reshape(U * Lp, -1), w)
        last = torch.arange(U, device=dev) * Lp + (Lp - 1)  # each prompt's last token
        logits = self._logits(res_TH[last], delta_TH[last])
        if self.U < self.B:  # rows sharing a prompt: one (B, V) copy of its logits each; none when all differ
            logits = logits.index_select(0, self.prompt_row_B)
        self._sample(logits, self.first_temperature or self.temperature)

    def _decode_step(self) -> None:
        """One token for every row: fixed shapes, no host sync (graph-capturable)."""
        ops, p = self.ops, self.p
        res_BH, delta_BH = F.embedding(self.tok_B, p.embed.weight), None
        for i, w in enumerate(self.w):
            res_BH, h_BH = ops.add_rmsnorm(res_BH, delta_BH, w.ln1, w.ln1_eps)
            qkv_BX = F.linear(h_BH, w.qkv_w, w.qkv_b)
            o_BD = ops.decode_attention(qkv_BX, self.prompt_k[i], self.prompt_v[i], self.gen_k[i], self.gen_v[i],
                                        self.prompt_row_B, self.start_B, self.step_1, self.pos_B, self.inv_freq,
                                        self.rope_scale, self.sm_scale, p.n_heads, p.n_kv, need_B=self.need_B)
            res_BH, delta_BH = self._after_attention(res_BH, o_BD, w)
        self._sample(self._logits(res_BH, delta_BH), self.temperature)

    def _after_attention(self, res: torch.Tensor, attn_out: torch.Tensor,
                         w: _LayerWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer after its attention: o_proj, residual + RMSNorm, gated MLP. Returns (residual, MLP out)."""
        res, h = self.ops.add_rmsnorm(res, F.linear(attn_out, w.o_w, w.o_b), w.ln2, w.ln2_eps)
        return res, F.linear(self.ops.silu_mul(F.linear(h, w.gate_up_w, w.gate_up_b)), w.down_w, w.down_b)

    def _logits(self, res: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The last layer's residual add, the final norm and the LM head."""
        _, h = self.ops.add_rmsnorm(res, delta, self.p.norm.weight, float(self.p.norm.variance_epsilon))
        return F.linear(h, self.p.head.weight, self.p.head.bias)

    def _sample(self, raw_logits_BV: torch.Tensor, temperature: float) -> None:
        """Draw token ``step_1`` of every row; temperature alone is folded into the sampling kernel."""
        if self.top_k > 0 or self.top_p < 1.0:
            logits_BV, inv_temperature = process_logits(raw_logits_BV, temperature, self.top_k, self.top_p), 1.0
        else:
            logits_BV, inv_temperature = raw_logits_BV, 1.0 / temperature
        tokens_B, logp_B = self.ops.race_sample(logits_BV, inv_temperature, self.seeds_B, self.step_1,
                                                need_B=self.need_B)
        self.tokens_BN.index_copy_(1, self.step_1, tokens_B.unsqueeze(-1))
        self.logp_BN.index_copy_(1, self.step_1, logp_B.unsqueeze(-1))
        is_stop_B = (tokens_B.unsqueeze(-1) == self.stop_K).any(-1)
        unset_B = self.first_stop_B == self.n_new
        self.first_stop_B.copy_(torch.where(is_stop_B & unset_B, self.step_1, self.first_stop_B))
        torch.minimum(self.first_stop_B + 1, self.limit_B, out=self.need_B)
        self.tok_B.copy_(tokens_B)
        self.pos_B.add_(1)
        self.step_1.add_(1)

    def compacted(self, rows: list[int]) -> StaticDecoder:
        """A decoder of only ``rows`` (indices into this one's), continuing from the same step: the shared
        weights and prompt entries, each kept row's state and generated cache gathered (queued on the
        stream behind the steps already launched, so no host sync), no graph yet."""
        new = copy.copy(self)
        at = torch.tensor(rows, dtype=torch.int64, device=self.tok_B.device)
        new.B, new.graph = len(rows), None
        new.gen_k = [t.index_select(0, at) for t in self.gen_k]
        new.gen_v = [t.index_select(0, at) for t in self.gen_v]
        for name in _ROW_STATE:
            setattr(new, name, getattr(self, name).index_select(0, at))
        new.step_1 = self.step_1.clone()
        return new

    # ---- driving ---------------------------------------------------------------------------------
    def capture(self, pool=None) -> None:
        """Record one decode step in a CUDA graph (after a warm-up step on a side stream), its temporaries
        in ``pool`` (a ``DecodeGraphPool`` id; None: a private pool of its own)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        saved = [t.clone() for t in self._state()]
        with torch.cuda.stream(stream):
            self._decode_step()  # warm-up: lazy inits and autotuning stay out of the graph
        torch.cuda.current_stream().wait_stream(stream)
        for t, s in zip(self._state(), saved):
            t.copy_(s)
        # the graph's private pool takes fresh device memory: hand the allocator's cached blocks back first
        # only when the device is short of it (capture_graph)
        if torch.cuda.mem_get_info(self.tok_B.device)[0] < step_bytes(self.p.head.weight.shape[0], self.B):
            torch.cuda.empty_cache()
        self.graph = torch.cuda.CUDAGraph()
        capture_graph(self.graph, self._decode_step, pool)
        for t, s in zip(self._state(), saved):  # capture ran the step once more: undo it
            t.copy_(s)

    def _state(self) -> list[torch.Tensor]:
        return [self.tokens_BN, self.logp_BN, self.first_stop_B, self.need_B, self.tok_B, self.pos_B, self.step_1]

    def run_steps(self, n: int) -> None:
        """Queue ``n`` more decode steps (no host sync)."""
        for _ in range(n):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._decode_step()


# a decoder's per-row tensors (dimension 0 is the row), besides the generated caches: what compaction gathers
_ROW_STATE = ("prompt_row_B", "start_B", "seeds_B", "tokens_BN", "logp_BN", "first_stop_B", "limit_B", "need_B",
              "tok_B", "last_prompt_pos_B", "pos_B")

# Compaction (generate_chunk_static): once the rows still decoding are at most this fraction of the decoder's, and
# at least COMPACT_MIN_STEPS steps may remain, the chunk goes on with a decoder of those rows only (a long-tailed
# batch's late steps otherwise pay the GEMMs of every finished row). Not below COMPACT_MIN_ROWS rows: a capture
# costs more than small GEMMs save.
COMPACT_FRACTION = 0.25
COMPACT_MIN_ROWS = 16
COMPACT_MIN_STEPS = 128


def should_compact(running: int, rows: int, steps_left: int) -> bool:
    return rows >= COMPACT_MIN_ROWS and running <= COMPACT_FRACTION * rows and steps_left >= COMPACT_MIN_STEPS


class _BlockReadback:
    """Host copies of the columns ``a .. b`` of tokens/log-probs and of the first-stop positions, queued
    behind the steps that produced them: pinned, non-blocking copies and an event on CUDA, so the host
    reads a block while the GPU already decodes the next one. ``rows``: the chunk's request index of each
    of the decoder's rows (compaction drops finished ones)."""

    def __init__(self, dec: StaticDecoder, a: int, b: int, rows: list[int]):
        self.a, self.b, self.rows = a, b, rows
        cuda = dec.tokens_BN.is_cuda

        def snap(t: torch.Tensor) -> torch.Tensor:
            return t.to("cpu", non_blocking=True) if cuda else t.clone()

        self.tokens, self.logp, self.first_stop = snap(dec.tokens_BN[:, a:b]), snap(dec.logp_BN[:, a:b]), \
            snap(dec.first_stop_B)
        self.event = torch.cuda.Event() if cuda else None
        if self.event is not None:
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class DecodeGraphPool:
    """One memory pool for all of an engine's decode graphs, kept for the engine's life.

    A graph captured in a private pool of its own leaves that pool's memory to be freed only by
    ``torch.cuda.empty_cache`` once the graph is gone, so each rollout's capture took fresh device memory
    and something had to empty the cache every step (the engine's sleep did, which also handed the
    learner's cached blocks back to the driver). Captured in one shared pool, each chunk's graph reuses the
    memory of the one before. Sharing is safe because chunks run one at a time (``HFEngine._exclusive``)
    and a chunk's graph is never replayed after its chunk ends.

    The last graph is kept until the next capture: a pool whose graphs are all gone has a use count of 0,
    and capturing into it again fails an internal assertion in PyTorch (seen with torch 2.11 on the H200,
    in the pinned host allocator's pool of the same id)."""

    def __init__(self):
        self.id = torch.cuda.graph_pool_handle()
        self._last: torch.cuda.CUDAGraph | None = None

    def captured(self, graph: torch.cuda.CUDAGraph) -> None:
        self._last = graph  # the previous one goes now: the pool's count stays >= 1


def capture_graph(graph: torch.cuda.CUDAGraph, fn, pool=None) -> None:
    """Record ``fn``'s kernels into ``graph`` on a side stream, as ``torch.cuda.graph`` does, without that
    context's prelude: it synchronizes the device and empties both the device allocator's cache and the
    pinned host cache before every capture. The engine captures once per rollout, right after a train
    phase: emptying there hands the learner's cached blocks back to the driver only for the next train
    step to allocate them again, and freeing pinned host blocks stalls until the device is idle (the
    second rollout's capture took 1.9 s at 1.5B on the H200 against 0.06 s in later ones). The graph's
    private pool cannot use the allocator's cached blocks, and freeing them is not allowed while a
    capture runs, so ``StaticDecoder.capture`` empties the cache first when the device's free memory is
    below the step's headroom.

    ``thread_local``: only this thread's unsafe CUDA calls are refused during the capture. The default
    (global) mode also refuses other threads' calls, and a background checkpoint write or weight publish
    running beside the rollout then failed with "operation not permitted when stream is capturing"
    (seen on the H200 with checkpoint.save_every=1 and async saves)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)


async def generate_chunk_static(engine: HFEngine, requests: list[GenerationRequest],
                                start: float) -> AsyncIterator[GeneratedSample]:
    """The static-cache counterpart of ``HFEngine._generate_chunk``: same samples contract, rows yielded
    at the first host check (every ``engine.sync_every`` steps) after they finish. Steps are queued in
    blocks of ``sync_every`` and the host reads block k while the GPU decodes block k + 1."""
    cfg = engine.cfg
    version = engine.policy_version  # the engine pins its weights while this chunk runs (HFEngine._pin)
    limits = [r.new_tokens(cfg.max_new_tokens) for r in requests]
    n_new = max(limits)

    def prepare(ops: ModuleType) -> StaticDecoder:
        dec = StaticDecoder(engine.module, [r.prompt_ids for r in requests], [r.seed for r in requests],
                            n_new, engine.pad_token_id, sorted(engine.stop_token_ids), cfg.temperature,
                            cfg.first_token_temperature, cfg.top_k, cfg.top_p, engine.device, ops, limits)
        dec.prefill()
        if cfg.cuda_graphs and n_new > 1:
            try:
                if engine.decode_graph_pool is None:
                    engine.decode_graph_pool = DecodeGraphPool()
                dec.capture(engine.decode_graph_pool.id)  # its warm-up step also compiles the decode kernels
                engine.decode_graph_pool.captured(dec.graph)
            except RuntimeError as exc:
                if is_triton_failure(exc):
                    raise
                warnings.warn(f"engine.cuda_graphs: capture failed ({exc}); decoding without CUDA graphs")
                dec.graph = None
        return dec

    def setup() -> StaticDecoder:
        with torch.no_grad():
            try:
                return prepare(engine.decode_ops)
            except Exception as exc:
                if engine.decode_ops is decode_ops or cfg.decode_kernels != "auto" or not is_triton_failure(exc):
                    raise
                # auto chose Triton but it cannot compile or run here: say so once, decode with the torch ops
                warnings.warn(f"engine.decode_kernels=auto: the Triton kernels failed ({type(exc).__name__}: {exc}); "
                              "decoding with the torch ops from now on (set engine.decode_kernels=torch to skip)")
                engine.decode_ops = decode_ops
                return prepare(decode_ops)

    blocks: deque[_BlockReadback] = deque()
    launched = 1  # tokens queued so far (prefill samples token 0)
    rows = list(range(len(requests)))  # the request of each of the decoder's rows

    def launch_next() -> None:  # one more block of steps and its readback, behind what is queued
        nonlocal launched
        n = min(cfg.sync_every, n_new - launched)
        with torch.no_grad():
            dec.run_steps(n)
            blocks.append(_BlockReadback(dec, launched, launched + n, rows))
        launched += n

    def start_decoding() -> None:
        blocks.append(_BlockReadback(dec, 0, 1, rows))
        if launched < n_new:
            launch_next()

    compaction_failed = False

    def compact(running: set[int]) -> None:
        """Go on with a decoder of the ``running`` requests' rows only (queued behind the launched steps); after
        a failure, not again in this chunk."""
        nonlocal dec, rows, compaction_failed
        keep = [j for j, i in enumerate(rows) if i in running]
        try:
            with torch.no_grad():
                smaller = dec.compacted(keep)
                if dec.graph is not None:
                    smaller.capture(engine.decode_graph_pool.id)
                    engine.decode_graph_pool.captured(smaller.graph)
        except RuntimeError as exc:  # out of memory, a failed capture: the decoder in use is intact, keep it
            if is_triton_failure(exc):
                raise
            warnings.warn(f"hf engine: compacting the chunk's {dec.B} rows to {len(keep)} failed ({exc}); "
                          "decoding on with every row")
            compaction_failed = True
            return
        dec, rows = smaller, [rows[j] for j in keep]

    dec = await asyncio.to_thread(setup)
    await asyncio.to_thread(start_decoding)
    B = len(requests)
    tokens_BN = torch.zeros((B, n_new), dtype=torch.int64)
    logp_BN = torch.zeros((B, n_new), dtype=torch.float32)
    pending = set(range(B))
    # from here the host only waits on the GPU, a block ahead: background host work may hold the driver
    try:
        with engine.host_idle.opened():
            while pending:
                block = blocks.popleft()
                await asyncio.to_thread(block.wait)
                if launched < n_new:  # keep the GPU one block ahead of the host
                    await asyncio.to_thread(launch_next)
                at = slice(None) if len(block.rows) == B else torch.tensor(block.rows)
                tokens_BN[at, block.a: block.b] = block.tokens
                logp_BN[at, block.a: block.b] = block.logp
                stop_of, done = dict(zip(block.rows, block.first_stop.tolist())), block.b
                for i in sorted(pending):
                    stop_at = stop_of[i]
                    if stop_at < limits[i] and stop_at < done:
                        n, reason = stop_at + 1, "stop"
                    elif done >= limits[i]:
                        n, reason = limits[i], "length"
                    else:
                        continue
                    pending.discard(i)
                    yield GeneratedSample(request_id=requests[i].request_id,
                                          response_ids=tokens_BN[i, :n].tolist(),
                                          logprobs=logp_BN[i, :n].tolist(), finish_reason=reason,
                                          policy_version=version, seconds=time.perf_counter() - start,
                                          token_versions=[version] * n)
                if pending and not compaction_failed and should_compact(len(pending), dec.B,
                                                                        max(limits[i] for i in pending) - launched):
                    await asyncio.to_thread(compact, set(pending))
    finally:
        for block in blocks:  # the queued steps still use the decoder's buffers and graph
            block.wait()
        del dec


__all__ = ["StaticDecoder", "check_static_support", "decode_kernels", "generate_chunk_static", "is_triton_failure"]
