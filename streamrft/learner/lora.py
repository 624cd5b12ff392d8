"""LoRA for the policy (model.lora_rank > 0), through peft, applied in place before sharding.

LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models") replaces a frozen linear
map W (out, in) by

    y = W x + (alpha / r) * B A x,      A: (r, in) random, B: (out, r) zeros at init,

so only A and B train. ``apply_lora`` injects peft LoRA layers into the HF model *in place*
(``peft.inject_adapter_in_model``, not a PeftModel wrapper), so the model keeps its class,
``get_decoder()`` and decoder layers, and FSDP2/DeepSpeed shard it unchanged. Parameter names become
``<module>.base_layer.weight`` and ``<module>.lora_A.default.weight`` / ``lora_B``; everything that is
not an adapter is frozen. Call it before ``model.freeze_prefix`` is applied: adapters under a frozen
prefix (e.g. a vision tower) then stay frozen too.

Engines that need full weights (vLLM, SGLang, a separate HF engine) take ``merge_lora_named_tensors``:
W' = W + (alpha / r) B A under the base HF name, streamed (one module buffered at a time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Iterator

import torch

if TYPE_CHECKING:
    from streamrft.config.model import ModelConfig

ADAPTER = "default"  # the peft adapter name
_BASE, _A, _B = ".base_layer.", f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"


def validate_lora(model_cfg: ModelConfig) -> None:
    """Raise ValueError for LoRA settings that cannot run."""
    if model_cfg.lora_rank < 0:
        raise ValueError(f"model.lora_rank={model_cfg.lora_rank} must be >= 0 (0 = no LoRA)")
    if model_cfg.lora_rank > 0:
        if model_cfg.lora_alpha <= 0:
            raise ValueError(f"model.lora_alpha={model_cfg.lora_alpha} must be > 0")
        if not model_cfg.lora_target_modules:
            raise ValueError("model.lora_target_modules is empty; name module suffixes such as q_proj, v_proj")


def lora_scaling(model_cfg: ModelConfig) -> float:
    return model_cfg.lora_alpha / model_cfg.lora_rank


def apply_lora(model: torch.nn.Module, model_cfg: ModelConfig) -> torch.nn.Module:
    """Inject LoRA adapters (model.lora_rank, lora_alpha, lora_target_modules) in place; freeze the rest.

    Returns ``model`` (same object). A no-op when model.lora_rank == 0."""
    validate_lora(model_cfg)
    if model_cfg.lora_rank == 0:
        return model
    from peft import LoraConfig, inject_adapter_in_model

    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = [t for t in model_cfg.lora_target_modules if t not in names]
    if missing:
        raise ValueError(f"model.lora_target_modules entries {missing} match no Linear module; "
                         f"this model's Linear names are {sorted(names)}")
    config = LoraConfig(r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha, lora_dropout=0.0,
                        target_modules=list(model_cfg.lora_target_modules), bias="none")
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name))
    return model


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def merge_lora_named_tensors(named: Iterable[tuple[str, torch.Tensor]], scaling: float
                             ) -> Iterator[tuple[str, torch.Tensor]]:
    """Fold adapters into base weights: yields (base HF name, tensor) with W' = W + scaling * B @ A.

    ``named`` is a full (unsharded) state dict stream of a model after ``apply_lora``; names without
    adapters pass through. The merge is computed in float32 and cast back to W's dtype."""
    pending: dict[str, dict[str, torch.Tensor]] = {}  # module prefix -> {"W", "A", "B"}

    def ready(prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        parts = pending[prefix]
        if len(parts) == 3:
            del pending[prefix]
            w = parts["W"]
            delta = parts["B"].float() @ parts["A"].float()
            yield f"{prefix}.weight", (w.float() + scaling * delta).to(w.dtype)

    for name, t in named:
        if name.endswith(_A) or name.endswith(_B):
            prefix = name[: -len(_A)]
            pending.setdefault(prefix, {})["A" if name.endswith(_A) else "B"] = t
            yield from ready(prefix)
        elif _BASE in name:
            prefix, leaf = name.split(_BASE)
            if leaf == "weight":
                pending.setdefault(prefix, {})["W"] = t
                yield from ready(prefix)
            else:
                yield f"{prefix}.{leaf}", t  # bias and other base leaves keep their value
        else:
            yield name, t
    if pending:
        raise RuntimeError(f"LoRA merge: incomplete modules {sorted(pending)[:3]} (missing base or A/B)")


def merged_state_for_engine(model: torch.nn.Module, model_cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The merged weights of an unsharded (or already gathered) LoRA model, names as the base HF state
    dict; plain state_dict items when model.lora_rank == 0."""
    items = ((n, t.detach()) for n, t in model.state_dict().items())
    if model_cfg.lora_rank == 0:
        return iter(items)
    return merge_lora_named_tensors(items, lora_scaling(model_cfg))
