"""The SGLang rollout engine: a client of a running SGLang server's native HTTP API (``engine.address``).

Calls used (request/response fields as in SGLang's ``http_server.py`` and ``managers/io_struct.py``):

- ``POST /generate`` ``{"rid", "input_ids", "sampling_params": {temperature, top_p, top_k, max_new_tokens,
  stop_token_ids, sampling_seed}, "return_logprob": true}`` →
  ``{"output_ids", "meta_info": {"finish_reason": {"type": "stop"|"length", ...},
  "output_token_logprobs": [[logprob, token_id, text], ...]}}``. One HTTP call per request, all in
  flight at once (SGLang batches them), so each sample is yielded when its own call returns.
- ``POST /release_memory_occupation`` / ``POST /resume_memory_occupation`` ``{"tags": null}`` for
  ``sleep`` / ``wake`` (the server needs ``--enable-memory-saver``).
- ``POST /update_weights_from_tensor`` ``{"serialized_named_tensors": [one entry per TP rank],
  "load_format": null, "flush_cache": true, "weight_version"}`` (``engine.weight_sync=tensor``, same node).
  Each entry is base64 of torch's ``ForkingPickler`` dump of ``[(name, tensor), ...]``: SGLang's own
  format, which carries CUDA IPC handles, not the data. This is the one pickle on a wire in StreamRFT,
  imposed by SGLang's API; use it only with a server on the same node (a loopback address).
- ``POST /init_weights_update_group`` ``{"master_address", "master_port", "rank_offset": 1,
  "world_size", "group_name", "backend"}`` once, then per bucket ``POST /update_weights_from_distributed``
  ``{"names", "dtypes", "shapes", "group_name", "flush_cache", "weight_version"}`` while this process
  (rank 0 of that group) broadcasts each tensor in order (``engine.weight_sync=distributed``).

Behaviour log-probs: SGLang reports ``log softmax(logits / T)`` of the sampled token (unless the server
sets ``SGLANG_RETURN_ORIGINAL_LOGPROB``, which it must not), i.e. before top-k / top-p truncation. That
equals the sampled distribution only without truncation, so ``engine.top_k`` must be 0 and
``engine.top_p`` 1; ``top_k=1`` (greedy) is sent as ``temperature=0`` and its log-probs are 0.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
import urllib.error
import urllib.request
from datetime import timedelta
from typing import TYPE_CHECKING, AsyncIterator, Iterable

import torch

from streamrft.config.validate import validate_sampling  # shared by every engine
from streamrft.engines.base import GeneratedSample, GenerationRequest, check_requests, wait_for_version

if TYPE_CHECKING:
    from streamrft.config.engine import EngineConfig

GROUP_NAME = "streamrft_weight_update"


def http_json(method: str, url: str, body: dict | None, timeout_s: float):
    """One JSON HTTP call; returns the decoded JSON (None for an empty or non-JSON 2xx body).
    Raises RuntimeError naming the URL, the status and the server's message."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{method} {url} failed with HTTP {exc.code}: {exc.read()[:500]!r}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise RuntimeError(f"{method} {url} failed: {exc}; is the server running at that address?") from None
    try:
        return json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return None


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(named, output_str=True)`` format."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode()


def join_weight_group(backend: str, address: str, world_size: int, rank: int, group_name: str,
                      timeout_s: float) -> torch.distributed.ProcessGroup:
    """A process group apart from torchrun's, rendezvoused at ``tcp://address`` (rank 0 hosts the store),
    keyed like SGLang's ``init_custom_process_group`` (store prefixed by ``group_name``)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{address}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def validate_sglang_config(cfg: EngineConfig) -> None:
    validate_sampling(cfg)
    if not cfg.address.startswith(("http://", "https://")):
        raise ValueError(f"engine.address={cfg.address!r}: engine.type=sglang needs the server URL, "
                         "e.g. http://127.0.0.1:30000")
    if cfg.first_token_temperature > 0:
        raise ValueError(f"engine.first_token_temperature={cfg.first_token_temperature} is not supported by "
                         "engine.type=sglang; set it to 0")
    if cfg.top_k > 1 or cfg.top_p < 1.0:
        raise ValueError(f"engine.top_k={cfg.top_k}, engine.top_p={cfg.top_p}: SGLang reports log-probs before "
                         "top-k/top-p truncation, so they would not be the sampled distribution's; set "
                         "engine.top_k=0 (or 1 for greedy) and engine.top_p=1")
    if cfg.sleep_level not in (1, 2):
        raise ValueError(f"engine.sleep_level={cfg.sleep_level} must be 1 or 2")
    if cfg.weight_group_server_ranks < 1:
        raise ValueError(f"engine.weight_group_server_ranks={cfg.weight_group_server_ranks} must be >= 1")


class SGLangEngine:
    """RolloutEngine over a remote SGLang server (see the module docstring)."""

    def __init__(self, cfg: EngineConfig, eos_token_ids: list[int], policy_version: int = 0):
        validate_sglang_config(cfg)
        self.cfg = cfg
        self.url = cfg.address.rstrip("/")
        self.stop_token_ids = sorted(set(cfg.stop_token_ids) | set(eos_token_ids))
        self.policy_version = policy_version
        self.timings: dict[str, float] = {}  # last weight_push / sleep / wake seconds
        self._group = None  # the distributed weight group, joined on the first distributed push
        self._active = 0

    supports_media = False  # media prompts need engine.type=hf

    def quiesce(self) -> None:
        """Generation runs in the engine's own workers, not in a thread on the learner's module."""

    def with_config(self, cfg: EngineConfig) -> SGLangEngine:
        """Another client of the same server with other sampling settings (e.g. greedy evaluation)."""
        return SGLangEngine(cfg, self.stop_token_ids, self.policy_version)

    async def _call(self, path: str, body: dict | None) -> dict | None:
        return await asyncio.to_thread(http_json, "POST", self.url + path, body, self.cfg.request_timeout_s)

    # ------------------------------------------------------------------ generation

    def _body(self, r: GenerationRequest) -> dict:
        greedy = self.cfg.top_k == 1
        params = {
            "temperature": 0.0 if greedy else self.cfg.temperature, "top_p": 1.0, "top_k": -1,
            "max_new_tokens": r.new_tokens(self.cfg.max_new_tokens),
            "stop_token_ids": self.stop_token_ids, "sampling_seed": r.seed, "skip_special_tokens": False,
        }
        return {"rid": r.request_id, "input_ids": list(r.prompt_ids), "sampling_params": params, "return_logprob": True}

    async def _one(self, r: GenerationRequest, start: float) -> GeneratedSample:
        out = await self._call("/generate", self._body(r))
        meta = out["meta_info"]
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason not in ("stop", "length"):
            raise RuntimeError(f"SGLang finished request {r.request_id!r} with finish_reason={meta.get('finish_reason')!r}")
        ids = [int(t) for t in out["output_ids"]]
        logps = [0.0] * len(ids) if self.cfg.top_k == 1 else [float(e[0]) for e in meta["output_token_logprobs"]]
        if len(logps) != len(ids):
            raise RuntimeError(f"SGLang returned {len(ids)} tokens but {len(logps)} log-probs for {r.request_id!r}")
        return GeneratedSample(request_id=r.request_id, response_ids=ids, logprobs=logps, finish_reason=reason,
                               policy_version=self.policy_version, seconds=time.perf_counter() - start,
                               token_versions=[self.policy_version] * len(ids))

    async def generate(self, requests: list[GenerationRequest], mm_inputs: dict | None = None) -> AsyncIterator[GeneratedSample]:
        """Yield each sample as soon as its own call returns."""
        if mm_inputs:
            raise ValueError("engine.type=sglang cannot take media prompts yet; use engine.type=hf")
        check_requests(requests, self.cfg.max_new_tokens)
        start = time.perf_counter()
        self._active += 1
        tasks = [asyncio.create_task(self._one(r, start)) for r in requests]
        try:
            for done in asyncio.as_completed(tasks):
                yield await done
        finally:
            for t in tasks:
                t.cancel()
            self._active -= 1

    async def generate_all(self, requests: list[GenerationRequest], mm_inputs: dict | None = None) -> list[GeneratedSample]:
        by_id = {s.request_id: s async for s in self.generate(requests, mm_inputs)}
        return [by_id[r.request_id] for r in requests]

    # ------------------------------------------------------------------ lifecycle and weights

    async def sleep(self, level: int = 1) -> None:
        """Release the server's KV cache and weights (SGLang's release frees both; ``level`` is accepted for
        the interface: both levels release everything the memory saver tracks)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level={level} must be 1 or 2; set engine.sleep_level")
        started = time.perf_counter()
        await self._call("/release_memory_occupation", {"tags": None})
        self.timings["sleep"] = time.perf_counter() - started

    async def wake(self) -> None:
        started = time.perf_counter()
        await self._call("/resume_memory_occupation", {"tags": None})
        self.timings["wake"] = time.perf_counter() - started

    async def wait_version(self, version: int, timeout_s: float = 600.0) -> None:
        """update_weights loads a version before it returns (never mid-generation): this only checks."""
        await wait_for_version(self, version, timeout_s)

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push one bucket (HF names), then set ``policy_version``; a version below the engine's is an error."""
        if version < self.policy_version:
            raise ValueError(f"update_weights: version {version} is older than the engine's policy_version "
                             f"{self.policy_version}; weight pushes must not go back in time")
        started = time.perf_counter()
        bucket = [(name, t.detach().contiguous()) for name, t in named_tensors]
        if bucket and self.cfg.weight_sync == "tensor":
            payload = serialize_named_tensors(bucket)
            await self._call("/update_weights_from_tensor", {
                "serialized_named_tensors": [payload] * self.cfg.weight_group_server_ranks,
                "load_format": None, "flush_cache": True, "weight_version": str(version)})
        elif bucket:
            await self._push_distributed(bucket, version)
        self.policy_version = version
        self.timings["weight_push"] = time.perf_counter() - started

    async def _push_distributed(self, bucket: list[tuple[str, torch.Tensor]], version: int) -> None:
        world = 1 + self.cfg.weight_group_server_ranks
        if self._group is None:
            host, port = self.cfg.weight_group_address.rsplit(":", 1)
            init = self._call("/init_weights_update_group", {
                "master_address": host, "master_port": int(port), "rank_offset": 1, "world_size": world,
                "group_name": GROUP_NAME, "backend": self.cfg.weight_group_backend})
            join = asyncio.to_thread(join_weight_group, self.cfg.weight_group_backend, self.cfg.weight_group_address,
                                     world, 0, GROUP_NAME, self.cfg.request_timeout_s)
            _, self._group = await asyncio.gather(init, join)
        update = self._call("/update_weights_from_distributed", {
            "names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket], "group_name": GROUP_NAME, "flush_cache": True,
            "weight_version": str(version)})
        await asyncio.gather(update, asyncio.to_thread(self._broadcast, bucket))

    def _broadcast(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        for _, tensor in bucket:
            torch.distributed.broadcast(tensor, src=0, group=self._group)

    def close(self) -> None:
        """Leave the distributed weight group (the server keeps its side until destroy_weights_update_group)."""
        if self._group is not None:
            torch.distributed.destroy_process_group(self._group)
            self._group = None
