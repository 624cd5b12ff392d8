"""The embedded rollout engine: batched, KV-cached sampling with a Hugging Face causal LM in process.

In colocated mode (the default) ``module`` IS the learner's model (possibly FSDP2-sharded; the caller
unshards it before ``generate``); the engine never copies it, and its weights change only while no
``generate()`` runs. With ``own_weights=True`` (the async placement's engine process) ``module`` is a
private copy that receives weights through ``update_weights`` at any time, also mid-generation: see
"In-flight weight updates" below and docs/engines.md.

Decoding, per chunk of at most ``engine.max_batch_size`` requests:

1. Prefill: prompts are left-padded to the chunk's longest prompt; ``attention_mask`` hides the pads
   and explicit ``position_ids = cumsum(mask) - 1`` give every real token the position it would have
   alone, so a padded row decodes like the row alone (within fp32 noise).
2. Decode: each step feeds the last sampled token of every unfinished row with the KV cache
   (``transformers.DynamicCache``), samples from ``process_logits`` with the row's own seeded
   generator (``GenerationRequest.seed``) and records ``log p(token)`` under the distribution
   actually sampled from.
3. A row finishes on a stop token (``engine.stop_token_ids`` or the tokenizer's EOS unless
   ``engine.ignore_eos``; the stop token is
   kept as the last entry of ``response_ids``, finish_reason ``"stop"``) or when it reaches its
   ``max_new_tokens`` (finish_reason ``"length"``). It is yielded at once and dropped from the batch
   and the cache, so short answers flow on while long ones still decode.

``engine.static_cache`` switches to the preallocated-cache, on-device-sampling path of ``hf_fast.py``
(optionally CUDA-graph replayed, ``engine.cuda_graphs``), for GPUs.

Every forward runs in a worker thread (``asyncio.to_thread``), so other coroutines of the event loop
(reward scoring, channels) progress while the model computes.

In-flight weight updates (``own_weights=True``): ``update_weights(named, v)`` waits for the forward in
progress (``_forward_lock``), copies the tensors in and sets ``policy_version = v``; no forward ever sees
half of a version. The next decode step of every text chunk in flight notices that its KV cache was
computed under an older version and re-prefills its unfinished rows (prompt + tokens so far) under the
new weights, so every token's log-prob is the one a full forward under the version that sampled it gives
(``token_versions`` records that version per token). Chunks that cannot be re-prefilled (static cache:
weights are concatenated per chunk; multimodal prompts: the media would have to be encoded again)
*pin* the weights: an update arriving meanwhile is staged (``pending_version``) and loaded when the last
pinned chunk ends. ``wait_version(v)`` returns once ``v`` is loaded. Static-cache chunks run one at a time, so
with own weights the ``generate()`` calls waiting behind a chunk are merged into the next one
(``engines/call_merge.py``): the async placement's Generator makes one call per admitted group.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Iterable

import torch
from transformers import DynamicCache

from streamrft.engines.base import GeneratedSample, GenerationRequest, check_requests, wait_for_version
from streamrft.engines.call_merge import CallMerger
from streamrft.engines.chunk_memory import DecoderShape, chunk_bytes, free_device_bytes, rows_that_fit
from streamrft.engines.sampling import logprob_of, process_logits, sample_tokens
from streamrft.runtime.host_idle import HostIdleWindow

if TYPE_CHECKING:
    from streamrft.config.engine import EngineConfig


def validate_engine_config(cfg: EngineConfig) -> None:
    """Raise ValueError (ConfigError) for settings the hf engine cannot run."""
    from streamrft.config.validate import validate_sampling

    validate_sampling(cfg)
    if cfg.cuda_graphs and not cfg.static_cache:
        raise ValueError("engine.cuda_graphs=true needs engine.static_cache=true")
    if cfg.sync_every < 1:
        raise ValueError(f"engine.sync_every={cfg.sync_every} must be >= 1")


def _cache_kwarg(module: torch.nn.Module) -> str:
    """The forward keyword for the KV cache: ``cache`` (transformers >= 5.x) or ``past_key_values``."""
    for sub in module.modules():
        params = inspect.signature(sub.forward).parameters
        if "cache" in params:
            return "cache"
        if "past_key_values" in params:
            return "past_key_values"
    return "past_key_values"


def _new_cache(module: torch.nn.Module) -> DynamicCache:
    config = getattr(module, "config", None)
    try:
        return DynamicCache(config=config) if config is not None else DynamicCache()
    except TypeError:  # older transformers: DynamicCache() takes no config
        return DynamicCache()


@dataclass
class _Row:
    """Decode state of one unfinished sequence."""

    request: GenerationRequest
    max_new_tokens: int
    generator: torch.Generator
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # per response token: the policy version that sampled it


@dataclass
class _Chunk:
    """Decode state of one chunk's unfinished rows: the next forward's inputs and the KV cache, which
    holds keys/values computed under weights of ``version`` (None before the first forward)."""

    rows: list[_Row]
    cache: DynamicCache
    input_ids_BL: torch.Tensor
    mask_BL: torch.Tensor
    position_ids_BL: torch.Tensor
    extra: dict[str, torch.Tensor]  # prefill-only media inputs
    pinned: bool  # weights may not change under this chunk (multimodal prompts)
    version: int | None = None


class HFEngine:
    """RolloutEngine over an in-process ``torch.nn.Module`` (a Hugging Face causal LM)."""

    def __init__(
        self,
        module: torch.nn.Module,
        cfg: EngineConfig,
        eos_token_ids: list[int],
        pad_token_id: int,
        device: torch.device,
        policy_version: int = 0,
        own_weights: bool = False,
    ):
        validate_engine_config(cfg)
        self.module = module
        self._eos_token_ids = list(eos_token_ids)
        # True: ``module`` is this engine's private copy (async placement), so update_weights may land while
        # generate() runs; False: it is the learner's model, whose weights must not change under a generate()
        self.own_weights = own_weights
        self.cfg = cfg
        eos = frozenset() if cfg.ignore_eos else frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(cfg.stop_token_ids) | eos
        if cfg.static_cache:
            from streamrft.engines.hf_fast import check_static_support, decode_kernels

            check_static_support(module)
            # the fused decode ops (hf_fast); chosen now, so an unusable choice fails here
            self.decode_ops = decode_kernels(cfg.decode_kernels, torch.device(device))
            if cfg.cuda_graphs and torch.device(device).type != "cuda":
                raise ValueError(f"engine.cuda_graphs=true needs a CUDA device, got {device}; "
                                 "set engine.cuda_graphs=false")
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)
        self.policy_version = policy_version
        # open while the static-cache decode loop only waits on the GPU (runtime/host_idle.py): background host
        # work that holds the CUDA driver's lock (the checkpoint prewarm's page-locking) runs then
        self.host_idle = HostIdleWindow()
        self._cache_kwarg = _cache_kwarg(module)
        # media placeholder ids (Qwen2-VL image/video pad, Qwen2-Audio <|AUDIO|>) are never sampled: a response
        # holding one could not be re-scored, since the model would look for media features to put there
        config = getattr(module, "config", None)
        self._banned_ids = sorted({i for key in ("image_token_id", "video_token_id", "audio_token_id")
                                   if isinstance(i := getattr(config, key, None), int)})
        self._active = 0  # generate() calls in flight; the module's mode is restored when it drops to 0
        self._was_training = False
        self._asleep = False
        self._offloaded_from: torch.device | None = None
        # held by the worker thread for each forward: a cancelled generate() leaves its thread running, and
        # FSDP swaps the module's registered parameters during a forward (see quiesce)
        self._forward_lock = threading.Lock()
        self._static_lock: asyncio.Lock | None = None  # one static-cache chunk at a time (see _exclusive)
        self._merger: CallMerger | None = None  # own_weights + static cache: calls in flight share chunks
        self._shape: DecoderShape | None = None  # what a static chunk's memory depends on (_chunk_rows)
        self._warned_chunk_memory = False
        # the static-cache decode graphs' memory pool, one for the engine's life (hf_fast.DecodeGraphPool)
        self.decode_graph_pool = None
        # weight switching (own_weights): chunks in flight that pin the weights, and what waits for them.
        # Lock order: _switch_lock, then _forward_lock.
        self._switch_lock = threading.Lock()
        self._pinned = 0
        self._staged: dict[str, torch.Tensor] = {}
        # the newest version handed to update_weights and not loaded yet (staged behind a pinned chunk, or
        # being copied in); None when policy_version is the newest
        self.pending_version: int | None = None
        self.reprefills = 0  # chunks re-prefilled after a weight switch (tests, logs)

    # ------------------------------------------------------------------ generation

    async def generate(
        self, requests: list[GenerationRequest], mm_inputs: dict[str, dict[str, torch.Tensor]] | None = None,
    ) -> AsyncIterator[GeneratedSample]:
        """Yield each sample as soon as its own sequence ends (stop token or length), not at batch end.

        ``mm_inputs`` (multimodal prompts): request_id -> that prompt's ``build_model_inputs`` dict
        (streamrft.models.multimodal); its ``input_ids`` must equal the request's ``prompt_ids``. The
        prefill forward gets the media tensors (pixel_values / input_features ...) and, for Qwen2-VL,
        (3, B, L) M-RoPE positions from the model's ``get_rope_index``; decode steps use the KV cache only.
        """
        if self._asleep:
            raise RuntimeError("HFEngine.generate called while asleep; call await engine.wake() first")
        self._validate_requests(requests)
        if mm_inputs and self.cfg.static_cache:
            raise ValueError("multimodal prompts need the dynamic-cache path; set engine.static_cache=false")
        start = time.perf_counter()
        self._enter()
        try:
            if self.cfg.static_cache:
                if self.own_weights:  # calls in flight share chunks (engines/call_merge.py)
                    async for sample in self._call_merger().generate(requests):
                        yield sample
                    return
                while requests:  # chunks of at most engine.max_batch_size rows, and what fits in memory
                    size = self._chunk_rows(requests[: self.cfg.max_batch_size])
                    async for sample in self._static_chunk(requests[:size], start):
                        yield sample
                    requests = requests[size:]
                return
            size = self.cfg.max_batch_size
            for lo in range(0, len(requests), size):
                async for sample in self._generate_chunk(requests[lo : lo + size], start, mm_inputs):
                    yield sample
        finally:
            self._exit()

    def _static_chunk(self, requests: list[GenerationRequest], start: float) -> AsyncIterator[GeneratedSample]:
        from streamrft.engines.hf_fast import generate_chunk_static

        return self._exclusive(self._pinned_chunk(generate_chunk_static(self, requests, start)))

    def _call_merger(self) -> CallMerger:
        if self._merger is None:
            self._merger = CallMerger(lambda reqs: self._static_chunk(reqs, time.perf_counter()),
                                      self.cfg.max_batch_size, self._chunk_rows)
        return self._merger

    def _chunk_rows(self, requests: list[GenerationRequest]) -> int:
        """How many of ``requests`` (in order) the next static-cache chunk takes: all of them, or as many as
        its preallocated KV cache lets fit in the device memory free now (engines/chunk_memory.py). Fewer
        rows per chunk change the batch a row decodes in (a bf16 GEMM's rounding), so the first time it
        happens a warning says so; a row that cannot fit alone is an error naming the sizes."""
        free = free_device_bytes(self.device)
        if free is None:
            return len(requests)
        from streamrft.engines.hf_fast import decoder_shape

        if self._shape is None:
            self._shape = decoder_shape(self.module)
        n_new = max(r.new_tokens(self.cfg.max_new_tokens) for r in requests)
        prompts = [r.prompt_ids for r in requests]
        fit = rows_that_fit(self._shape, prompts, n_new, free)
        gib = lambda rows: chunk_bytes(self._shape, prompts[:rows], n_new) / 2**30  # noqa: E731
        if fit == 0:
            raise RuntimeError(
                f"hf engine on {self.device}: one row of a {len(prompts[0])}-token prompt and {n_new} new tokens "
                f"needs {gib(1):.2f} GiB for its static KV cache and decode buffers, and {free / 2**30:.2f} GiB "
                "is free (within rollout.engine_memory_fraction where set); lower engine.max_new_tokens, give "
                "the engine more memory, or set engine.static_cache=false")
        if fit < len(requests) and not self._warned_chunk_memory:
            self._warned_chunk_memory = True
            warnings.warn(
                f"hf engine on {self.device}: a chunk of {len(requests)} rows with up to {n_new} new tokens needs "
                f"{gib(len(requests)):.2f} GiB for its static KV cache and decode buffers and {free / 2**30:.2f} "
                f"GiB is free, so chunks take {fit} rows at a time (and rows may round differently in a smaller "
                "batch); lower engine.max_batch_size or engine.max_new_tokens, or give the engine more memory "
                "(rollout.engine_memory_fraction in the async placement)")
        return fit

    async def _exclusive(self, chunk: AsyncIterator[GeneratedSample]) -> AsyncIterator[GeneratedSample]:
        """One static-cache chunk at a time: a chunk owns a preallocated KV cache and captures CUDA graphs,
        and a capture fails when another thread launches work meanwhile (two generate() calls in flight,
        as the long-lived Generator makes when it admits more groups before the first call ends)."""
        if self._static_lock is None:
            self._static_lock = asyncio.Lock()
        async with self._static_lock:
            try:
                async for sample in chunk:
                    yield sample
            finally:
                await chunk.aclose()

    async def _pinned_chunk(self, chunk: AsyncIterator[GeneratedSample]) -> AsyncIterator[GeneratedSample]:
        """Run ``chunk`` with the weights pinned: an update meanwhile is staged until it ends."""
        self._pin()
        try:
            async for sample in chunk:
                yield sample
        finally:
            try:
                await chunk.aclose()  # closed early: its own cleanup (queued steps) runs before the unpin
            finally:
                self._unpin()

    async def generate_all(
        self, requests: list[GenerationRequest], mm_inputs: dict[str, dict[str, torch.Tensor]] | None = None,
    ) -> list[GeneratedSample]:
        """All samples, in request order."""
        by_id = {s.request_id: s async for s in self.generate(requests, mm_inputs)}
        return [by_id[r.request_id] for r in requests]

    def _validate_requests(self, requests: list[GenerationRequest]) -> None:
        check_requests(requests, self.cfg.max_new_tokens)
        limit = getattr(getattr(self.module, "config", None), "max_position_embeddings", None)
        for r in requests:
            n_new = r.new_tokens(self.cfg.max_new_tokens)
            if limit is not None and len(r.prompt_ids) + n_new > limit:
                raise ValueError(
                    f"request {r.request_id!r}: prompt of {len(r.prompt_ids)} tokens + max_new_tokens={n_new} "
                    f"exceeds the model's max_position_embeddings={limit}; shorten the prompt or lower "
                    "engine.max_new_tokens")

    def _enter(self) -> None:
        if self._active == 0:
            self._was_training = self.module.training
            self.module.eval()
        self._active += 1

    def _exit(self) -> None:
        self._active -= 1
        if self._active == 0:
            self.module.train(self._was_training)

    async def _generate_chunk(
        self, requests: list[GenerationRequest], start: float, mm_inputs: dict | None = None,
    ) -> AsyncIterator[GeneratedSample]:
        rows = [
            _Row(
                request=r,
                max_new_tokens=r.new_tokens(self.cfg.max_new_tokens),
                generator=torch.Generator(device=self.device).manual_seed(r.seed),
                response_ids=[],
                logprobs=[],
                versions=[],
            )
            for r in requests
        ]
        input_ids_BL, mask_BL, position_ids_BL = self._left_pad([r.prompt_ids for r in requests])
        extra: dict[str, torch.Tensor] = {}
        if mm_inputs:
            input_ids_BL, mask_BL, position_ids_BL, extra = self._multimodal_prefill(requests, mm_inputs)
        chunk = _Chunk(rows, _new_cache(self.module), input_ids_BL, mask_BL, position_ids_BL, extra,
                       pinned=bool(mm_inputs))
        if chunk.pinned:
            self._pin()
        try:
            async for sample in self._decode(chunk, start):
                yield sample
        finally:
            if chunk.pinned:
                self._unpin()
            del chunk

    async def _decode(self, chunk: _Chunk, start: float) -> AsyncIterator[GeneratedSample]:
        step = 0
        while chunk.rows:
            temperature = self.cfg.temperature
            if step == 0 and self.cfg.first_token_temperature > 0:
                temperature = self.cfg.first_token_temperature
            tokens, logps, version = await asyncio.to_thread(self._step, chunk, temperature)
            keep: list[int] = []
            finished: list[GeneratedSample] = []
            for i, (row, token, logp) in enumerate(zip(chunk.rows, tokens, logps)):
                row.response_ids.append(token)
                row.logprobs.append(logp)
                row.versions.append(version)
                if token in self.stop_token_ids:
                    reason = "stop"
                elif len(row.response_ids) >= row.max_new_tokens:
                    reason = "length"
                else:
                    keep.append(i)
                    continue
                finished.append(GeneratedSample(
                    request_id=row.request.request_id,
                    response_ids=row.response_ids,
                    logprobs=row.logprobs,
                    finish_reason=reason,
                    policy_version=row.versions[0],
                    seconds=time.perf_counter() - start,
                    token_versions=row.versions,
                ))
            for sample in finished:
                yield sample
            if not keep:
                break
            tokens_B1 = torch.tensor(tokens, device=self.device).unsqueeze(-1)
            mask_BL, position_ids_BL = chunk.mask_BL, chunk.position_ids_BL
            if len(keep) < len(chunk.rows):
                keep_B = torch.tensor(keep, device=self.device)
                chunk.cache.batch_select_indices(keep_B)
                mask_BL, tokens_B1 = mask_BL[keep_B], tokens_B1[keep_B]
                position_ids_BL = position_ids_BL[:, keep_B] if position_ids_BL.dim() == 3 else position_ids_BL[keep_B]
                chunk.rows = [chunk.rows[i] for i in keep]
            chunk.input_ids_BL = tokens_B1
            chunk.mask_BL = torch.cat([mask_BL, torch.ones_like(mask_BL[:, :1])], dim=1)
            if position_ids_BL.dim() == 3 and step == 0:  # M-RoPE: next text position = max position + 1
                chunk.position_ids_BL = position_ids_BL.amax(dim=(0, 2), keepdim=True).expand(3, -1, 1) + 1
            else:
                chunk.position_ids_BL = position_ids_BL[..., -1:] + 1
            step += 1

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids (B, L), attention_mask (B, L), position_ids (B, L) for left-padded prompts."""
        length = max(len(p) for p in prompts)
        ids_BL = torch.full((len(prompts), length), self.pad_token_id, dtype=torch.long)
        mask_BL = torch.zeros((len(prompts), length), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids_BL[i, length - len(p):] = torch.tensor(p, dtype=torch.long)
            mask_BL[i, length - len(p):] = 1
        position_ids_BL = (mask_BL.cumsum(dim=1) - 1).clamp(min=0)
        return ids_BL.to(self.device), mask_BL.to(self.device), position_ids_BL.to(self.device)

    def _multimodal_prefill(
        self, requests: list[GenerationRequest], mm_inputs: dict[str, dict[str, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Left-padded prefill of multimodal prompts: (input_ids, mask, position_ids, media kwargs);
        position_ids are (3, B, L) M-RoPE ids for Qwen2-VL, (B, L) otherwise."""
        from streamrft.models.multimodal import collate_prompts, forward_kwargs

        per_row = []
        for r in requests:
            inputs = mm_inputs.get(r.request_id)
            if inputs is None:
                ids = torch.tensor([r.prompt_ids], dtype=torch.long)
                inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
                if any("mm_token_type_ids" in x for x in mm_inputs.values()):
                    inputs["mm_token_type_ids"] = torch.zeros_like(ids)
            elif inputs["input_ids"][0].tolist() != list(r.prompt_ids):
                raise ValueError(f"request {r.request_id!r}: mm_inputs input_ids differ from prompt_ids; build both "
                                 "from the same build_model_inputs call")
            per_row.append(inputs)
        batch = {k: v.to(self.device) for k, v in collate_prompts(per_row, self.pad_token_id).items()}
        kwargs = forward_kwargs(self.module, batch)
        input_ids_BL, mask_BL, position_ids = kwargs.pop("input_ids"), kwargs.pop("attention_mask"), kwargs.pop("position_ids")
        return input_ids_BL, mask_BL, position_ids, kwargs

    def _step(self, chunk: _Chunk, temperature: float) -> tuple[list[int], list[float], int]:
        """One forward (prefill, re-prefill or decode) and one sampled token per row, and the policy version
        that sampled them. Runs in a worker thread, so grad mode is set here (it is thread-local).

        Under ``_forward_lock`` the weights cannot change (update_weights takes it too), so the version read
        here is the one of every weight this forward uses. A cache computed under an older version is
        dropped and the rows' prompts + tokens so far are prefilled again: decoding on old keys/values would
        give log-probs of neither version."""
        with self._forward_lock, torch.no_grad():
            version = self.policy_version
            if chunk.version is not None and chunk.version != version:
                if chunk.pinned:  # _pin forbids this; a new code path that forgets to pin must not go on silently
                    raise RuntimeError(f"HFEngine: weights switched from version {chunk.version} to {version} "
                                       "under a pinned chunk")
                chunk.input_ids_BL, chunk.mask_BL, chunk.position_ids_BL = self._left_pad(
                    [row.request.prompt_ids + row.response_ids for row in chunk.rows])
                chunk.cache = _new_cache(self.module)
                self.reprefills += 1
            chunk.version = version
            out = self.module(
                input_ids=chunk.input_ids_BL,
                attention_mask=chunk.mask_BL,
                position_ids=chunk.position_ids_BL,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kwarg: chunk.cache},
                **chunk.extra,
            )
            chunk.extra = {}
            raw_BV = out.logits[:, -1, :]
            if self._banned_ids:
                raw_BV = raw_BV.clone()
                raw_BV[:, self._banned_ids] = float("-inf")
            logits_BV = process_logits(raw_BV, temperature, self.cfg.top_k, self.cfg.top_p)
            tokens_B = sample_tokens(logits_BV, [row.generator for row in chunk.rows])
            logp_B = logprob_of(logits_BV, tokens_B)
        return tokens_B.tolist(), logp_B.tolist(), version

    # ------------------------------------------------------------------ lifecycle and weights

    supports_media = True

    def with_config(self, cfg: EngineConfig) -> "HFEngine":
        """Another engine on the same module with other sampling settings (the greedy evaluation)."""
        engine = HFEngine(self.module, cfg, self._eos_token_ids, self.pad_token_id, self.device,
                          policy_version=self.policy_version, own_weights=self.own_weights)
        engine.host_idle = self.host_idle  # one host, one window
        return engine

    @property
    def host_idle_window(self) -> HostIdleWindow | None:
        """The window, where this engine's rollouts open it (the static-cache decode loop); else None."""
        return self.host_idle if self.cfg.static_cache else None

    def close(self) -> None:
        """Nothing beyond the module, which belongs to the learner (or to this process)."""

    def quiesce(self) -> None:
        """Return once no forward is running in a worker thread. A generate() cancelled by a signal does
        not stop the forward its thread is in; a checkpoint taken meanwhile would see FSDP's unsharded
        parameters registered on the module instead of the optimizer's sharded ones."""
        with self._forward_lock:
            pass

    async def sleep(self, level: int = 1) -> None:
        """Level 1: nothing to free. The engine keeps no KV cache between calls: a chunk's cache went back
        to this process's caching allocator when the chunk ended, and the learner, in this process when
        colocated, allocates from that same cache. Handing it to the driver here (``empty_cache``) made
        every train step allocate its ~270 segments again (benchmarks/NOTES.md v14).
        Level 2: also move the weights to CPU when they live on an accelerator (no-op on CPU), and return
        the allocator's cached memory to the driver, for other processes on the device."""
        if level not in (1, 2):
            raise ValueError(f"sleep level={level} must be 1 or 2; set engine.sleep_level")
        if self._active:
            raise RuntimeError(f"HFEngine.sleep called with {self._active} generate() calls in flight; "
                               "finish or cancel them first")
        if level == 2:
            param = next(self.module.parameters(), None)
            if param is not None and param.device.type != "cpu":
                self._offloaded_from = param.device
                self.module.to("cpu")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self._asleep = True

    async def wake(self) -> None:
        """Undo ``sleep``: move offloaded weights back to their device."""
        if self._offloaded_from is not None:
            self.module.to(self._offloaded_from)
            self._offloaded_from = None
        self._asleep = False

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy tensors into the module's parameters/buffers by name, then set ``policy_version = version``.

        Names are the module's own ``state_dict`` names (tied weights may appear under either name).
        In colocated mode the module already is the learner's model: call ``update_weights([], version)``,
        which only bumps the version; there any call while a ``generate()`` runs is an error.

        With ``own_weights=True`` this may be called while ``generate()`` runs (from this event loop, or
        from another thread's): it waits for the forward in progress, loads the version whole and returns
        (text chunks re-prefill at their next step); with a pinned chunk in flight (static cache,
        multimodal prompts) it stages a copy and returns at once, ``pending_version = version``, and the
        copy is loaded when the last pinned chunk ends. ``await wait_version(version)`` returns once loaded.
        While generating, each version must arrive in one call: a second call for the version already
        loaded would change weights under tokens already labelled with it.
        """
        named = list(named_tensors)  # a bucket iterator is drained before anything changes
        self._check_update(named, version)
        if not self.own_weights:
            self._copy_in(named)
            self.policy_version = version
            return
        await asyncio.to_thread(self._load_or_stage, named, version)

    async def wait_version(self, version: int, timeout_s: float = 600.0) -> None:
        """Return once the weights of ``version`` (or newer) are loaded: tokens sampled from then on carry it."""
        staged = f", version {self.pending_version} staged behind {self._pinned} pinned chunk(s)" if self._pinned else ""
        await wait_for_version(self, version, timeout_s, staged)

    def _check_update(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Every error before any weight changes: version order, the generate() rule, names, shapes."""
        newest = max(self.policy_version, self.pending_version if self.pending_version is not None else -1)
        if version < newest:
            raise ValueError(f"update_weights: version {version} is older than the engine's version {newest}; "
                             "weight pushes must not go back in time")
        if self._active and not self.own_weights:
            raise RuntimeError(f"HFEngine.update_weights(version={version}) called with {self._active} generate() "
                               "calls in flight on the learner's own module (own_weights=False): its weights may "
                               "not change under them; finish the rollout first, or give the engine a private "
                               "copy with own_weights=True")
        if self._active and named and version == newest:
            raise ValueError(f"update_weights: version {version} is already loaded and generate() is running; "
                             "while generating, send each version whole in one call (rows would otherwise sample "
                             "from partly updated weights under one version label)")
        targets = self._targets()
        for name, tensor in named:
            target = targets.get(name)
            if target is None:
                raise ValueError(f"update_weights: the engine's module has no parameter named {name!r}; "
                                 "send names from the same model class (state_dict names)")
            if target.shape != tensor.shape:
                raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)} but the engine "
                                 f"expects {tuple(target.shape)}")

    def _targets(self) -> dict[str, torch.Tensor]:
        targets = dict(self.module.named_parameters(remove_duplicate=False))
        targets.update(dict(self.module.named_buffers(remove_duplicate=False)))
        return targets

    def _copy_in(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        targets = self._targets()
        with torch.no_grad():
            for name, tensor in named:
                targets[name].copy_(tensor)

    def _load_or_stage(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Worker thread: load the version now, between two forwards, or stage it behind pinned chunks."""
        with self._switch_lock:
            if self._pinned:
                targets = self._targets()
                for name, tensor in named:  # a copy: the caller may reuse its bucket buffers
                    target = targets[name]
                    self._staged[name] = tensor.detach().to(target.device, target.dtype, copy=True)
                self.pending_version = version
                return
            self.pending_version = version
            with self._forward_lock:
                self._copy_in(named)
                self.policy_version = version
            self.pending_version = None

    def _pin(self) -> None:
        """A chunk that cannot re-prefill starts: weights stay as they are until it ends."""
        with self._switch_lock:
            self._pinned += 1

    def _unpin(self) -> None:
        """A pinned chunk ended; the last one loads what was staged meanwhile. Synchronous on purpose: it runs
        in a generator's ``finally``, where an await could be skipped by a second cancellation and leave the
        version staged for ever; the copy is one version's worth, done at most once per version."""
        with self._switch_lock:
            self._pinned -= 1
            if self._pinned or self.pending_version is None:
                return
            with self._forward_lock:
                self._copy_in(self._staged.items())
                self.policy_version = self.pending_version
            self._staged.clear()
            self.pending_version = None
