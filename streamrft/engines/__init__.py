"""Rollout engines, chosen by ``engine.type`` through the explicit ``ENGINES`` dict.

Each entry is a builder ``(cfg, module, tokenizer, device, model_path="", own_weights=False) -> RolloutEngine``.
Builders import their engine inside the function, so optional backends (vllm, sglang) are imported only when selected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from streamrft.engines.base import GeneratedSample, GenerationRequest, RolloutEngine

if TYPE_CHECKING:
    from streamrft.config.engine import EngineConfig


def eos_ids_of(tokenizer, module: torch.nn.Module | None = None) -> list[int]:
    """EOS ids from the tokenizer plus the model's generation config (which may list several)."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    extra = getattr(getattr(module, "generation_config", None), "eos_token_id", None)
    for i in extra if isinstance(extra, (list, tuple)) else ([] if extra is None else [extra]):
        if int(i) not in ids:
            ids.append(int(i))
    return ids


def _build_hf(cfg: EngineConfig, module: torch.nn.Module, tokenizer, device: torch.device,
              model_path: str = "", own_weights: bool = False) -> RolloutEngine:
    from streamrft.engines.hf import HFEngine

    eos = eos_ids_of(tokenizer, module)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    return HFEngine(module, cfg, eos_token_ids=eos, pad_token_id=int(pad), device=device, own_weights=own_weights)


def _build_vllm(cfg: EngineConfig, module: torch.nn.Module | None, tokenizer, device: torch.device,
                model_path: str = "", own_weights: bool = False) -> RolloutEngine:
    """vLLM loads the model itself from ``model_path`` (the learner's ``model.path``)."""
    if not model_path and not cfg.address:
        raise ValueError("engine.type=vllm in process needs the model directory; pass model_path=cfg.model.path")
    from streamrft.engines.vllm import VLLMEngine

    param = None if module is None else next(module.parameters(), None)
    dtype = "auto" if param is None else param.dtype
    return VLLMEngine(cfg, model_path, tokenizer, device, eos_token_ids=eos_ids_of(tokenizer, module), dtype=dtype)


def _build_sglang(cfg: EngineConfig, module: torch.nn.Module | None, tokenizer, device: torch.device,
                  model_path: str = "", own_weights: bool = False) -> RolloutEngine:
    from streamrft.engines.sglang import SGLangEngine

    return SGLangEngine(cfg, eos_token_ids=eos_ids_of(tokenizer, module))


ENGINES: dict[str, Callable[..., RolloutEngine]] = {
    "hf": _build_hf,
    "vllm": _build_vllm,
    "sglang": _build_sglang,
}


def build_engine(cfg: EngineConfig, module: torch.nn.Module, tokenizer, device: torch.device,
                 model_path: str = "", own_weights: bool = False) -> RolloutEngine:
    """The engine named by ``cfg.type`` (``engine.type`` in the config). ``model_path`` is the model
    directory (``model.path``), which the vllm engine loads itself. ``own_weights=True``: ``module`` is the
    engine's private copy, not the learner's model (async placement), so the hf engine takes weight updates
    while generating (docs/engines.md, "In-flight weight updates"); vllm and sglang always hold their own
    weights and load a version between generate() calls, whatever this says."""
    builder = ENGINES.get(cfg.type)
    if builder is None:
        raise ValueError(f"engine.type={cfg.type!r} is not available here; choose one of {sorted(ENGINES)}")
    return builder(cfg, module, tokenizer, device, model_path=model_path, own_weights=own_weights)


__all__ = ["ENGINES", "GeneratedSample", "GenerationRequest", "RolloutEngine", "build_engine", "eos_ids_of"]
