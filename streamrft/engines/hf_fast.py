"""The static-cache decode path of the hf engine (``engine.static_cache``, optionally ``engine.cuda_graphs``).

The eager path (``hf.py``) grows a ``DynamicCache``, copies every token to the host and draws one
random number per row from a ``torch.Generator`` at every step: fine on CPU, but on a GPU each decode
step then costs hundreds of small launches and a host sync. Here, for a chunk of B requests:

* the KV cache is preallocated once, ``k, v: (B, n_kv, L_prompt + N_new, head_dim)`` per layer, and a
  key-validity mask ``ok_B11S`` (bool) marks the real prompt tokens and the decoded slots;
* prefill and decode run the decoder's own submodules (norms, projections, MLP, rotary embedding)
  with our attention over that cache: for one query token, the ``n_heads / n_kv`` query heads that
  share a KV head are folded into the query-length axis, so plain SDPA does grouped-query attention
  with no copy of K/V:  ``q (B, n_kv, group, d) · k (B, n_kv, S, d)ᵀ``;
* sampling stays on the device: a counter-based uniform ``u = hash(seed, step)`` replaces the
  per-row generator (a row's draw still depends only on its own seed and step, never on its batch),
  then inverse-CDF sampling from ``softmax(process_logits(z))`` exactly as ``sampling.sample_tokens``;
* one decode step (forward, sampling, bookkeeping) has fixed shapes and no host syncs, so with
  ``engine.cuda_graphs`` it is captured once per chunk in a CUDA graph and replayed;
* the host reads the per-row first stop position only every ``engine.sync_every`` steps; finished
  rows keep decoding (masked out afterwards) until the whole chunk is done.

Supported: Llama/Qwen2-style decoders (``model.layers[i].self_attn.{q,k,v,o}_proj``, RMSNorm,
rotary embedding, no sliding window). The same seed gives the same tokens within this path; the
random stream differs from the eager path's.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

import torch
import torch.nn.functional as F

from streamrft.engines.base import GeneratedSample, GenerationRequest
from streamrft.engines.sampling import process_logits

if TYPE_CHECKING:
    from streamrft.engines.hf import HFEngine

_M32 = 0xFFFFFFFF
_SUPPORTED = ("qwen2", "llama", "mistral")


def check_static_support(module: torch.nn.Module) -> None:
    """ValueError when ``module`` is not a decoder this path can run."""
    config = getattr(module, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in _SUPPORTED:
        raise ValueError(f"engine.static_cache=true supports model types {_SUPPORTED}, got {kind!r}; "
                         "set engine.static_cache=false for this model")
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise ValueError("engine.static_cache=true does not support sliding-window attention "
                         f"(sliding_window={config.sliding_window}); set engine.static_cache=false")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply), on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def counter_uniform(seeds_B: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """u ∈ [0, 1) float64 per row, a pure function of (seed, step): 48 bits from two hashed words."""
    lo, hi = seeds_B & _M32, (seeds_B >> 32) & _M32
    s = _mix32((step.to(torch.int64) + 0x9E3779B9) & _M32)
    a = _mix32(lo ^ _mix32(hi ^ s))
    b = _mix32(a ^ 0x85EBCA6B)
    return ((a >> 8) * (1 << 24) + (b >> 8)).double() / float(1 << 48)


def sample_from_uniform(logits_BV: torch.Tensor, u_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw of one token per row from softmax(logits) given ``u_B``; returns (tokens, logp).

    ``logp = z[x] - logsumexp(z)`` is the log-prob of the drawn token under that distribution."""
    lse_B = torch.logsumexp(logits_BV, dim=-1)
    probs_BV = torch.exp(logits_BV - lse_B.unsqueeze(-1))
    cdf_BV = torch.cumsum(probs_BV, dim=-1)
    threshold_B1 = (u_B.to(cdf_BV.dtype) * cdf_BV[:, -1]).unsqueeze(-1)
    tokens_B = torch.searchsorted(cdf_BV, threshold_B1, right=True).squeeze(-1)
    vocab = logits_BV.shape[-1]
    last_positive_B = vocab - 1 - torch.argmax(torch.flip(probs_BV > 0, dims=[-1]).int(), dim=-1)
    tokens_B = torch.minimum(tokens_B, last_positive_B)
    logp_B = logits_BV.gather(-1, tokens_B.unsqueeze(-1)).squeeze(-1) - lse_B
    return tokens_B, logp_B


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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half form), x (B, H, T, d), cos/sin (B, T, d)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class StaticDecoder:
    """Decode state of one chunk: static KV cache, masks, output buffers (see the module docstring)."""

    def __init__(self, module, prompts: list[list[int]], seeds: list[int], n_new: int, pad_id: int,
                 stop_ids: list[int], temperature: float, first_temperature: float, top_k: int, top_p: float,
                 device: torch.device):
        self.p = _parts(module)
        self.temperature, self.first_temperature = temperature, first_temperature
        self.top_k, self.top_p = top_k, top_p
        B, Lp = len(prompts), max(len(p) for p in prompts)
        self.B, self.Lp, self.n_new, self.S = B, Lp, n_new, Lp + n_new
        dtype = self.p.embed.weight.dtype
        self.inv_freq = self.p.rotary.inv_freq.to(device=device, dtype=torch.float32)
        self.rope_scale = float(getattr(self.p.rotary, "attention_scaling", 1.0))
        ids_BL = torch.full((B, Lp), pad_id, dtype=torch.long)
        real_BL = torch.zeros((B, Lp), dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids_BL[i, Lp - len(p):] = torch.tensor(p, dtype=torch.long)
            real_BL[i, Lp - len(p):] = True
        self.ids_BL, self.real_BL = ids_BL.to(device), real_BL.to(device)
        self.pos_BL = (self.real_BL.long().cumsum(1) - 1).clamp(min=0)
        shape = (B, self.p.n_kv, self.S, self.p.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.p.layers]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.p.layers]
        self.ok_B11S = torch.zeros((B, 1, 1, self.S), dtype=torch.bool, device=device)
        self.ok_B11S[:, 0, 0, :Lp] = self.real_BL
        self.seeds_B = torch.tensor(seeds, dtype=torch.int64, device=device)
        self.stop_K = torch.tensor(sorted(stop_ids) or [-1], dtype=torch.int64, device=device)
        self.tokens_BN = torch.zeros((B, n_new), dtype=torch.int64, device=device)
        self.logp_BN = torch.zeros((B, n_new), dtype=torch.float32, device=device)
        self.first_stop_B = torch.full((B,), n_new, dtype=torch.int64, device=device)
        self.tok_B = torch.zeros((B,), dtype=torch.int64, device=device)
        self.pos_B = self.pos_BL[:, -1].clone()
        self.step_1 = torch.zeros((1,), dtype=torch.int64, device=device)  # index of the next sampled token
        self.graph: torch.cuda.CUDAGraph | None = None

    # ---- forward ---------------------------------------------------------------------------------
    def _layers(self, x_BTH: torch.Tensor, pos_BT: torch.Tensor, attend) -> torch.Tensor:
        # rotary embedding as the model's rotary_emb computes it, from a device copy of inv_freq (the
        # module's buffer may sit on the CPU after an FSDP offload; a host copy cannot be graph-captured)
        freqs_BTf = pos_BT[..., None].float() * self.inv_freq
        emb = torch.cat((freqs_BTf, freqs_BTf), dim=-1)
        cos, sin = (emb.cos() * self.rope_scale).to(x_BTH.dtype), (emb.sin() * self.rope_scale).to(x_BTH.dtype)
        B, T, _ = x_BTH.shape
        for i, layer in enumerate(self.p.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x_BTH)
            q = attn.q_proj(h).view(B, T, self.p.n_heads, self.p.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(B, T, self.p.n_kv, self.p.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(B, T, self.p.n_kv, self.p.head_dim).transpose(1, 2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            o_BTD = attend(i, q, k, v, attn.scaling)
            x_BTH = x_BTH + attn.o_proj(o_BTD)
            x_BTH = x_BTH + layer.mlp(layer.post_attention_layernorm(x_BTH))
        return self.p.norm(x_BTH)

    def prefill(self) -> None:
        """Run the prompts, fill the cache's first Lp slots, sample token 0."""
        B, Lp = self.B, self.Lp
        causal_LL = torch.ones((Lp, Lp), dtype=torch.bool, device=self.ids_BL.device).tril()
        eye_LL = torch.eye(Lp, dtype=torch.bool, device=self.ids_BL.device)
        mask_B1LL = (causal_LL & self.real_BL[:, None, :]) | eye_LL  # a pad query sees itself (no NaN)
        mask_B1LL = mask_B1LL.unsqueeze(1)
        group = self.p.n_heads // self.p.n_kv

        def attend(i, q, k, v, scale):
            self.k[i][:, :, :Lp].copy_(k)
            self.v[i][:, :, :Lp].copy_(v)
            k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            o = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask_B1LL, scale=scale)
            return o.transpose(1, 2).reshape(B, Lp, -1)

        h_BLH = self._layers(self.p.embed(self.ids_BL), self.pos_BL, attend)
        logits_BV = self.p.head(h_BLH[:, -1])
        self._sample(logits_BV, self.first_temperature or self.temperature)

    def _decode_step(self) -> None:
        """One token for every row: fixed shapes, no host sync (graph-capturable)."""
        B, group = self.B, self.p.n_heads // self.p.n_kv
        slot_1 = self.step_1 + (self.Lp - 1)  # the slot of the token being fed (sampled at step-1)
        self.ok_B11S.index_fill_(3, slot_1, True)

        def attend(i, q, k, v, scale):
            self.k[i].index_copy_(2, slot_1, k)
            self.v[i].index_copy_(2, slot_1, v)
            q_g = q.reshape(B, self.p.n_kv, group, self.p.head_dim)  # query head h uses kv head h // group
            o = F.scaled_dot_product_attention(q_g, self.k[i], self.v[i], attn_mask=self.ok_B11S, scale=scale)
            return o.reshape(B, 1, -1)

        h_B1H = self._layers(self.p.embed(self.tok_B.unsqueeze(-1)), self.pos_B.unsqueeze(-1), attend)
        self._sample(self.p.head(h_B1H[:, 0]), self.temperature)

    def _sample(self, raw_logits_BV: torch.Tensor, temperature: float) -> None:
        logits_BV = process_logits(raw_logits_BV, temperature, self.top_k, self.top_p)
        tokens_B, logp_B = sample_from_uniform(logits_BV, counter_uniform(self.seeds_B, self.step_1))
        self.tokens_BN.index_copy_(1, self.step_1, tokens_B.unsqueeze(-1))
        self.logp_BN.index_copy_(1, self.step_1, logp_B.unsqueeze(-1))
        is_stop_B = (tokens_B.unsqueeze(-1) == self.stop_K).any(-1)
        unset_B = self.first_stop_B == self.n_new
        self.first_stop_B.copy_(torch.where(is_stop_B & unset_B, self.step_1, self.first_stop_B))
        self.tok_B.copy_(tokens_B)
        self.pos_B.add_(1)
        self.step_1.add_(1)

    # ---- driving ---------------------------------------------------------------------------------
    def capture(self) -> None:
        """Record one decode step in a CUDA graph (after a warm-up step on a side stream)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        saved = [t.clone() for t in self._state()]
        with torch.cuda.stream(stream):
            self._decode_step()  # warm-up: lazy inits and autotuning stay out of the graph
        torch.cuda.current_stream().wait_stream(stream)
        for t, s in zip(self._state(), saved):
            t.copy_(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._decode_step()
        for t, s in zip(self._state(), saved):  # capture ran the step once more: undo it
            t.copy_(s)

    def _state(self) -> list[torch.Tensor]:
        return [self.ok_B11S, self.tokens_BN, self.logp_BN, self.first_stop_B, self.tok_B, self.pos_B, self.step_1]

    def run_steps(self, n: int) -> torch.Tensor:
        """Decode ``n`` more steps, then one host sync: returns first_stop_B on the CPU."""
        for _ in range(n):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._decode_step()
        return self.first_stop_B.cpu()


def kv_cache_bytes(module: torch.nn.Module, batch: int, length: int, dtype_bytes: int = 2) -> int:
    """Bytes of a static KV cache: layers · 2 · B · n_kv · S · d · dtype_bytes."""
    cfg = module.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * batch * cfg.num_key_value_heads * length * head_dim * dtype_bytes


async def generate_chunk_static(engine: HFEngine, requests: list[GenerationRequest],
                                start: float) -> AsyncIterator[GeneratedSample]:
    """The static-cache counterpart of ``HFEngine._generate_chunk``: same samples contract, rows yielded
    at the first host sync (every ``engine.sync_every`` steps) after they finish."""
    cfg = engine.cfg
    limits = [cfg.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens for r in requests]
    n_new = max(limits)

    def setup() -> StaticDecoder:
        with torch.no_grad():
            dec = StaticDecoder(engine.module, [r.prompt_ids for r in requests], [r.seed for r in requests],
                                n_new, engine.pad_token_id, sorted(engine.stop_token_ids), cfg.temperature,
                                cfg.first_token_temperature, cfg.top_k, cfg.top_p, engine.device)
            dec.prefill()
            if cfg.cuda_graphs and n_new > 1:
                try:
                    dec.capture()
                except RuntimeError as exc:  # keep decoding without the graph, loudly
                    warnings.warn(f"engine.cuda_graphs: capture failed ({exc}); decoding without CUDA graphs")
                    dec.graph = None
        return dec

    def advance(dec: StaticDecoder, n: int) -> torch.Tensor:
        with torch.no_grad():
            return dec.run_steps(n)

    dec = await asyncio.to_thread(setup)
    done = 1  # tokens sampled so far (prefill sampled token 0)
    first_stop = dec.first_stop_B.cpu()
    pending = set(range(len(requests)))
    while pending:
        finished = []
        for i in sorted(pending):
            stop_at = int(first_stop[i])
            if stop_at < limits[i] and stop_at < done:
                finished.append((i, stop_at + 1, "stop"))
            elif done >= limits[i]:
                finished.append((i, limits[i], "length"))
        if finished:
            idx = torch.tensor([i for i, _, _ in finished], device=dec.tokens_BN.device)
            tokens = dec.tokens_BN.index_select(0, idx).cpu().tolist()
            logps = dec.logp_BN.index_select(0, idx).cpu().tolist()
            for (i, n, reason), toks, lps in zip(finished, tokens, logps):
                pending.discard(i)
                yield GeneratedSample(request_id=requests[i].request_id, response_ids=toks[:n], logprobs=lps[:n],
                                      finish_reason=reason, policy_version=engine.policy_version,
                                      seconds=time.perf_counter() - start)
        if not pending:
            break
        n = min(cfg.sync_every, n_new - done)
        first_stop = await asyncio.to_thread(advance, dec, n)
        done += n
    del dec


__all__ = ["StaticDecoder", "check_static_support", "counter_uniform", "generate_chunk_static", "kv_cache_bytes",
           "sample_from_uniform"]
