"""The vLLM rollout engine: an in-process ``vllm.LLM`` (colocated) or a remote vLLM server (``engine.address``).

In process (``engine.address = ""``)
    One ``LLM`` per tensor-parallel group. vLLM's engine core runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here before vLLM is imported), so weight pushes hand the
    learner's tensors to the model runner by reference, with no serialization. Under torchrun on GPUs
    the LLM joins the existing process group (``distributed_executor_backend="external_launcher"``).
    ``generate`` adds requests to ``llm.llm_engine`` and steps it from one driver task; each sample is
    yielded when its own sequence finishes, and several ``generate`` calls may be in flight at once.

Remote (``engine.address = "http://host:port"``)
    ``POST /v1/completions`` with token-id prompts and ``return_token_ids``; ``POST /sleep?level=N`` and
    ``POST /wake_up`` (the server must run with ``VLLM_SERVER_DEV_MODE=1`` and ``--enable-sleep-mode``).
    Weight pushes to a remote vLLM server are not implemented (``update_weights`` with tensors raises).

Behaviour log-probs
    vLLM's default ``logprobs_mode="raw_logprobs"`` reports ``log softmax(logits)`` BEFORE temperature,
    top-k and top-p. The RolloutEngine contract needs the log-prob under the distribution actually
    sampled from, so the in-process LLM is built with ``logprobs_mode="processed_logprobs"``
    (``log softmax(mask_top_p(mask_top_k(logits / T)))``, the same as ``streamrft.engines.sampling``);
    a remote server must be started with ``--logprobs-mode processed_logprobs``. ``SamplingParams(logprobs=0)``
    returns exactly the sampled token's entry. Per-request ``seed = GenerationRequest.seed``.

Weights
    ``update_weights(named_tensors, version)`` hands HF-named tensors to every worker's
    ``reload_weights(weights_iterator=..., is_checkpoint_format=True)`` through ``LLM.collective_rpc``
    (a worker method name, so no code is serialized): vLLM restores the layer's checkpoint layout, loads,
    fuses q/k/v and gate/up and re-runs its kernel-specific processing (the CPU backend repacks linear
    weights, so calling ``model.load_weights`` directly fails after the first load). A layer is loaded
    only when all its tensors are there (``LayerBuffer``), so buckets may split layers anywhere. A version
    lower than the engine's is an error.

Shutdown
    ``close()`` stops the stepper and shuts the engine core down. vLLM's shutdown also destroys
    torch.distributed's default process group (``cleanup_dist_env_and_memory``), so call it last, after
    the run's own collectives; left to vLLM's exit-time finalizer instead, it runs after the driver has
    destroyed that group and fails with "Invalid process group specified".

Sleep
    vLLM's sleep mode (``enable_sleep_mode``) exists on CUDA/ROCm/XPU only; on CPU vLLM refuses it, so
    ``sleep``/``wake`` are no-ops there (logged once). Seconds spent are in ``engine.timings``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Iterable

import torch

from streamrft.engines.base import GeneratedSample, GenerationRequest, check_requests, wait_for_version
from streamrft.config.validate import validate_sampling
from streamrft.engines.sglang import http_json

if TYPE_CHECKING:
    from streamrft.config.engine import EngineConfig

log = logging.getLogger(__name__)

TIED_HEAD, TIED_EMBED = "lm_head.weight", "model.embed_tokens.weight"


def validate_vllm_config(cfg: EngineConfig) -> None:
    """Raise ValueError for settings the vllm engine cannot run."""
    validate_sampling(cfg)
    if cfg.first_token_temperature > 0:
        raise ValueError(f"engine.first_token_temperature={cfg.first_token_temperature} is not supported by "
                         "engine.type=vllm (no per-step temperature); set it to 0 or use engine.type=hf")
    if cfg.tensor_parallel_size < 1:
        raise ValueError(f"engine.tensor_parallel_size={cfg.tensor_parallel_size} must be >= 1")
    if not 0.0 < cfg.gpu_memory_utilization <= 1.0:
        raise ValueError(f"engine.gpu_memory_utilization={cfg.gpu_memory_utilization} must be in (0, 1]")
    if cfg.sleep_level not in (1, 2):
        raise ValueError(f"engine.sleep_level={cfg.sleep_level} must be 1 or 2")


def sampling_kwargs(cfg: EngineConfig, request: GenerationRequest, stop_token_ids: list[int]) -> dict:
    """vLLM SamplingParams fields for one request (also the /v1/completions body fields)."""
    return dict(
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k if cfg.top_k > 0 else -1,
        max_tokens=request.new_tokens(cfg.max_new_tokens),
        seed=request.seed, stop_token_ids=stop_token_ids, logprobs=0, skip_special_tokens=False,
    )


def checkpoint_names(model_path: str) -> list[str]:
    """Tensor names of the Hugging Face checkpoint in ``model_path`` (safetensors, single file or sharded)."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return sorted(json.loads(index.read_text())["weight_map"])
    if (root / "model.safetensors").is_file():
        with safe_open(str(root / "model.safetensors"), framework="pt") as f:
            return sorted(f.keys())
    raise ValueError(f"model path {model_path!r} has no model.safetensors(.index.json); engine.type=vllm needs "
                     "a directory saved with save_pretrained(safe_serialization=True)")


def load_group(name: str) -> str:
    """The unit vLLM must receive whole: a decoder layer (``...layers.N``), else the tensor's module."""
    parts = name.split(".")
    if "layers" in parts and parts.index("layers") + 1 < len(parts):
        return ".".join(parts[: parts.index("layers") + 2])
    return name.rsplit(".", 1)[0]


class LayerBuffer:
    """Holds pushed tensors until each load group (see ``load_group``) is complete.

    vLLM reloads a layer from its checkpoint-format tensors only when ALL of them arrive in one
    ``reload_weights`` call (q/k/v and gate/up are fused into one kernel tensor), so buckets that split
    a layer are regrouped here; at most one partial layer per bucket boundary is held. With tied
    embeddings ``lm_head.weight`` is the same parameter as ``model.embed_tokens.weight``: it is sent
    under that name, once.
    """

    def __init__(self, names: list[str], tied: bool):
        self.tied = tied
        names = [TIED_EMBED if (tied and n == TIED_HEAD) else n for n in names]
        self.expected: dict[str, set[str]] = {}
        for n in names:
            self.expected.setdefault(load_group(n), set()).add(n)
        self.held: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Buffer ``bucket``; return every tensor of the groups it completed."""
        ready: list[tuple[str, torch.Tensor]] = []
        touched: set[str] = set()
        for name, tensor in bucket:
            if self.tied and name == TIED_HEAD:
                name = TIED_EMBED
            group = load_group(name)
            if name not in self.expected.get(group, ()):
                raise ValueError(f"update_weights: {name!r} is not a tensor of the engine's checkpoint; send the "
                                 "model's Hugging Face state_dict names")
            self.held.setdefault(group, {})[name] = tensor
            touched.add(group)
        for group in touched:
            if self.held[group].keys() >= self.expected[group]:
                ready.extend(self.held.pop(group).items())
        return ready

    def incomplete(self) -> list[str]:
        return sorted(self.held)


def _refresh_tied_head(worker) -> None:
    """Runs in each worker (collective_rpc, in process): re-run the LM head's post-load processing.

    vLLM skips ``lm_head.weight`` when embeddings are tied, but the CPU backend packs a separate GEMM copy
    of the head weight at load time (``dispatch_cpu_unquantized_gemm``); without this the logits keep
    using the old embedding after a push."""
    head = worker.model_runner.model.lm_head
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


@dataclass
class _Call:
    """One generate() call: its requests by vLLM request id and the queue its samples arrive on."""

    requests: dict[str, GenerationRequest]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class _InProcessLLM:
    """Owns the ``vllm.LLM`` and the one task that steps it; shared by every view (``VLLMEngine.with_config``)."""

    def __init__(self, cfg: EngineConfig, model_path: str, dtype: str, device: torch.device):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise ValueError("engine.type=vllm in process needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (weights are "
                             "handed to the model runner by reference); unset it or set it to 0")
        from vllm import LLM

        self.on_cpu = device.type == "cpu"
        kwargs = dict(
            model=model_path, dtype=dtype, seed=0, tensor_parallel_size=cfg.tensor_parallel_size,
            enforce_eager=cfg.enforce_eager, logprobs_mode="processed_logprobs", max_num_seqs=cfg.max_batch_size,
            enable_sleep_mode=not self.on_cpu, enable_prefix_caching=False,
        )
        if cfg.max_model_len > 0:
            kwargs["max_model_len"] = cfg.max_model_len
        if cfg.kv_cache_memory_bytes > 0:
            kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
        if not self.on_cpu:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
            if torch.distributed.is_initialized():
                kwargs["distributed_executor_backend"] = "external_launcher"
        self.llm = LLM(**kwargs)
        tied = bool(getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))
        self.buffer = LayerBuffer(checkpoint_names(model_path), tied)
        self.buffer_version: int | None = None
        self.calls: dict[str, _Call] = {}  # vLLM request id -> its call
        self.pending: list[tuple[str, list[int], dict]] = []  # added to the engine between steps
        self.stepper: asyncio.Task | None = None
        self.asleep = False
        self.weights_awake = True

    def submit(self, call: _Call, stop_ids: list[int], cfg: EngineConfig) -> None:
        for rid, req in call.requests.items():
            if rid in self.calls:
                raise ValueError(f"request_id {rid!r} is already in flight; request ids must be unique")
            self.calls[rid] = call
            self.pending.append((rid, list(req.prompt_ids), sampling_kwargs(cfg, req, stop_ids)))
        if self.stepper is None or self.stepper.done():
            self.stepper = asyncio.create_task(self._step_loop(), name="vllm-stepper")

    def close(self) -> None:
        """Stop the stepper and shut the engine core down once (idempotent)."""
        if self.stepper is not None and not self.stepper.done():
            self.stepper.cancel()
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None

    async def _step_loop(self) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        try:
            while self.pending or self.calls:
                for rid, prompt_ids, kw in self.pending:
                    engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt_ids), SamplingParams(**kw))
                self.pending.clear()
                for out in await asyncio.to_thread(engine.step):
                    if out.finished:
                        call = self.calls.pop(out.request_id, None)
                        if call is None:
                            raise RuntimeError(f"vLLM returned unknown request id {out.request_id!r}")
                        call.queue.put_nowait(out)
        except BaseException as exc:  # a dead stepper must fail every waiting generate(), not hang it
            for call in {id(c): c for c in self.calls.values()}.values():
                call.queue.put_nowait(exc)
            self.calls.clear()
            raise


class VLLMEngine:
    """RolloutEngine over vLLM (see the module docstring for the two modes)."""

    def __init__(self, cfg: EngineConfig, model_path: str, tokenizer, device: torch.device | str = "cpu",
                 eos_token_ids: list[int] | None = None, dtype: torch.dtype | str = "auto", policy_version: int = 0,
                 _shared: _InProcessLLM | None = None):
        validate_vllm_config(cfg)
        self.cfg = cfg
        self.model_path = model_path
        self.device = torch.device(device)
        eos = list(eos_token_ids) if eos_token_ids is not None else (
            [] if tokenizer is None or tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)])
        self.stop_token_ids = sorted(set(cfg.stop_token_ids) | set(eos))
        self.policy_version = policy_version
        self.timings: dict[str, float] = {}  # last weight_push / sleep / wake seconds
        self.remote = bool(cfg.address)
        dtype_name = str(dtype).removeprefix("torch.")
        self._inproc = None if self.remote else (_shared or _InProcessLLM(cfg, model_path, dtype_name, self.device))
        self._active = 0

    supports_media = False  # media prompts need engine.type=hf

    def quiesce(self) -> None:
        """Generation runs in the engine's own workers, not in a thread on the learner's module."""

    def with_config(self, cfg: EngineConfig) -> VLLMEngine:
        """Another engine on the SAME vLLM instance with other sampling settings (e.g. greedy evaluation)."""
        return VLLMEngine(cfg, self.model_path, None, self.device, eos_token_ids=self.stop_token_ids,
                          policy_version=self.policy_version, _shared=self._inproc)

    def close(self) -> None:
        """Shut the in-process vLLM down (shared by every ``with_config`` view; idempotent). It destroys
        torch.distributed's default group too (see the module docstring): call it after the last collective."""
        if self._inproc is not None:
            self._inproc.close()

    # ------------------------------------------------------------------ generation

    async def generate(self, requests: list[GenerationRequest], mm_inputs: dict | None = None) -> AsyncIterator[GeneratedSample]:
        """Yield each sample as soon as its own sequence ends (stop token or length)."""
        if mm_inputs:
            raise ValueError("engine.type=vllm cannot take media prompts yet; use engine.type=hf")
        check_requests(requests, self.cfg.max_new_tokens)
        if self._inproc is not None and self._inproc.llm is None:
            raise RuntimeError("VLLMEngine.generate called after close(); build a new engine")
        if self._inproc is not None and self._inproc.asleep:
            raise RuntimeError("VLLMEngine.generate called while asleep; call await engine.wake() first")
        start = time.perf_counter()
        self._active += 1
        try:
            if self.remote:
                tasks = [asyncio.create_task(self._remote_one(r, start)) for r in requests]
                try:
                    for done in asyncio.as_completed(tasks):
                        yield await done
                finally:
                    for t in tasks:
                        t.cancel()
                return
            call = _Call({r.request_id: r for r in requests})
            self._inproc.submit(call, self.stop_token_ids, self.cfg)
            for _ in range(len(requests)):
                out = await call.queue.get()
                if isinstance(out, BaseException):
                    raise RuntimeError("the vLLM engine stepper failed") from out
                yield self._sample(call.requests[out.request_id], out.outputs[0].token_ids,
                                   [lp[t].logprob for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)],
                                   out.outputs[0].finish_reason, start)
        finally:
            self._active -= 1

    async def generate_all(self, requests: list[GenerationRequest], mm_inputs: dict | None = None) -> list[GeneratedSample]:
        """All samples, in request order."""
        by_id = {s.request_id: s async for s in self.generate(requests, mm_inputs)}
        return [by_id[r.request_id] for r in requests]

    def _sample(self, req: GenerationRequest, ids, logps, reason: str | None, start: float) -> GeneratedSample:
        if reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished request {req.request_id!r} with finish_reason={reason!r}; "
                               "expected 'stop' or 'length'")
        return GeneratedSample(request_id=req.request_id, response_ids=[int(t) for t in ids],
                               logprobs=[float(x) for x in logps], finish_reason=reason,
                               policy_version=self.policy_version, seconds=time.perf_counter() - start,
                               token_versions=[self.policy_version] * len(ids))

    async def _remote_one(self, req: GenerationRequest, start: float) -> GeneratedSample:
        body = {"model": self.model_path, "prompt": list(req.prompt_ids), "return_token_ids": True,
                "include_stop_str_in_output": True,
                **sampling_kwargs(self.cfg, req, self.stop_token_ids)}
        reply = await asyncio.to_thread(http_json, "POST", f"{self.cfg.address}/v1/completions", body,
                                        self.cfg.request_timeout_s)
        choice = reply["choices"][0]
        return self._sample(req, choice["token_ids"], choice["logprobs"]["token_logprobs"],
                            choice["finish_reason"], start)

    # ------------------------------------------------------------------ lifecycle and weights

    async def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1: weights offloaded to host memory; level 2: weights discarded)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level={level} must be 1 or 2; set engine.sleep_level")
        if self._active:
            raise RuntimeError(f"VLLMEngine.sleep called with {self._active} generate() calls in flight")
        started = time.perf_counter()
        if self.remote:
            await asyncio.to_thread(http_json, "POST", f"{self.cfg.address}/sleep?level={level}", None,
                                    self.cfg.request_timeout_s)
        elif self._inproc.on_cpu:
            log.info("vLLM's CPU backend has no sleep mode; engine.sleep(level=%d) keeps weights and KV cache", level)
            self._inproc.asleep = True
        else:
            await asyncio.to_thread(self._inproc.llm.sleep, level)
            self._inproc.asleep, self._inproc.weights_awake = True, False
        self.timings["sleep"] = time.perf_counter() - started

    async def wake(self) -> None:
        started = time.perf_counter()
        if self.remote:
            await asyncio.to_thread(http_json, "POST", f"{self.cfg.address}/wake_up", None, self.cfg.request_timeout_s)
        elif self._inproc.asleep:
            if not self._inproc.on_cpu:
                tags = None if not self._inproc.weights_awake else ["kv_cache"]
                await asyncio.to_thread(self._inproc.llm.wake_up, tags)
            self._inproc.asleep, self._inproc.weights_awake = False, True
        self.timings["wake"] = time.perf_counter() - started

    async def wait_version(self, version: int, timeout_s: float = 600.0) -> None:
        """update_weights loads a version before it returns (never mid-generation): this only checks."""
        await wait_for_version(self, version, timeout_s)

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load one bucket of HF-named tensors into every worker, then set ``policy_version = version``.

        Buckets of one push share a version; a version below the engine's is an error (a stale push).
        """
        if version < self.policy_version:
            raise ValueError(f"update_weights: version {version} is older than the engine's policy_version "
                             f"{self.policy_version}; weight pushes must not go back in time")
        if self._active:
            raise RuntimeError(f"VLLMEngine.update_weights called with {self._active} generate() calls in flight")
        started = time.perf_counter()
        bucket = [(name, t.detach()) for name, t in named_tensors]
        if bucket and self.remote:
            raise ValueError("update_weights: pushing tensors to a remote vLLM server (engine.address="
                             f"{self.cfg.address!r}) is not implemented; run vLLM in process (engine.address='') "
                             "or use engine.type=sglang")
        if bucket:
            inproc = self._inproc
            if inproc.asleep and not inproc.weights_awake:
                await asyncio.to_thread(inproc.llm.wake_up, ["weights"])
                inproc.weights_awake = True
            if inproc.buffer_version not in (None, version) and inproc.buffer.incomplete():
                raise ValueError(f"update_weights: the push of version {inproc.buffer_version} left layers "
                                 f"{inproc.buffer.incomplete()[:3]} incomplete; send every tensor of a layer")
            inproc.buffer_version = version
            ready = inproc.buffer.add(bucket)
            if ready:
                await asyncio.to_thread(inproc.llm.collective_rpc, "reload_weights",
                                        kwargs={"weights_iterator": ready, "is_checkpoint_format": True})
                if inproc.buffer.tied and any(name == TIED_EMBED for name, _ in ready):
                    await asyncio.to_thread(inproc.llm.collective_rpc, _refresh_tied_head)
        self.policy_version = version
        self.timings["weight_push"] = time.perf_counter() - started
