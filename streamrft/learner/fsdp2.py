"""The FSDP2 strategy: a Hugging Face causal LM sharded with ``fully_shard``, trained with AdamW.

Sharding: each decoder layer is its own FSDP group, and so is each block of a vision-language model's
vision tower and its merger (``media_encoder_units``: a 600M-parameter tower is not gathered whole for one
image); then the root (embeddings, patch embedding, final norm, LM head) is one more group; trainable parameters are
kept in float32 (frozen ones in the compute dtype: ``store_frozen_in``) and, when model.dtype is bf16/fp16, cast for
compute by a MixedPrecisionPolicy (gradients reduced in float32). Works at world size 1 on a one-rank group.

Gradient scaling: the caller's loss on each rank is already normalised by *global* token counts, so the
gradient we want is d/dθ sum_ranks loss_rank. FSDP2 averages gradients over ranks by default; we set the
gradient divide factor to 1 so its reduction is a plain sum. Microbatch gradients accumulate (no division
by the number of microbatches). Every rank must call forward_backward the same number of times per step
(pad with ``microbatch.padding_microbatch`` when a rank has fewer), because each backward reduces.

Gathered weights (``train.reshard_after_forward``): by default on several ranks each unit frees its gathered
compute-dtype weights after its forward and gathers them again for its backward, in every microbatch. With
false (the default on one rank, where a "gather" is only a cast copy of each weight, two kernels per weight
per gather), the units keep them from their first forward until ``release_gathered_weights`` (the optimizer
step, a save, a load, an offload, the engine's copy): one gather per unit per optimizer step. While they are
kept, ``module.parameters()`` are the gathered tensors (no ``.grad``); the sharded ones hold the gradients.

Gradient reduction: on several ranks every backward reduces (reduce-scatter, summed). On one rank the caller's
``last_before_step=False`` (the actor passes it for all but the last microbatch of a step) defers it: FSDP2 adds
each microbatch's gradients to per-unit float32 accumulators (the same additions, in the same order, as adding
them to the sharded gradients) and the last microbatch's backward reduces once.

Log-probs are computed by a forward method registered with FSDP (``register_fsdp_forward_method``), so the
root group is gathered around the chunked LM-head computation of ``logprobs.py``.
"""

from __future__ import annotations

import math
import os
import types
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from streamrft.config.train import HeadSettings, compile_layers_enabled, reshard_after_forward_enabled
from streamrft.learner.base import LossFn
from streamrft.learner.compiling import compile_decoder_layers
from streamrft.learner.memory import bucketed, move_module_and_optimizer
from streamrft.learner.logprobs import head_logprobs, head_positions
from streamrft.learner.optim import build_lr_scheduler, build_optimizer
from streamrft.learner.sharded_state import load_sharded_state, sharded_state
from streamrft.models.hub import resolve_model_dir

if TYPE_CHECKING:
    from streamrft.config.model import ModelConfig
    from streamrft.config.train import TrainConfig
    from streamrft.runtime.distributed import DistInfo

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOGPROB_METHOD = "streamrft_token_logprobs"  # the FSDP forward method added to the model instance
HEAD_SETTINGS_ATTR = "streamrft_head"  # instance attribute: the HeadSettings that method runs the LM head with


_MULTIMODAL_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_audio": "Qwen2AudioForConditionalGeneration"}


def load_pretrained(path: str, model_cfg: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
    """from_pretrained(path) on CPU in ``dtype``, with a clear error when missing: AutoModelForCausalLM, or the
    conditional-generation class of a vision-language / audio-language model (_MULTIMODAL_CLASSES)."""
    import json

    import transformers

    path = resolve_model_dir(path, "model.path")  # a directory, or a hub id's snapshot in the local HF cache
    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f).get("model_type", "")
    cls = getattr(transformers, _MULTIMODAL_CLASSES.get(model_type, "AutoModelForCausalLM"))
    return cls.from_pretrained(path, dtype=dtype, attn_implementation=model_cfg.attn_implementation)


def _logprob_method(self, mb: dict[str, torch.Tensor], temperature: float, with_entropy: bool):
    return head_logprobs(self, mb, temperature, with_entropy, self.__dict__[HEAD_SETTINGS_ATTR])


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a HF causal LM (``model.get_decoder().layers``)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers at get_decoder().layers; "
                         "this model family is not supported by the fsdp2 strategy yet")
    return list(layers)


def media_encoder_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The vision tower's blocks, then its merger, of a Qwen2-VL-family model (``model.visual`` in
    transformers >= 5, ``visual`` before); [] for a model without a vision tower. Each becomes its own FSDP
    unit, so the tower is gathered one block at a time like the decoder."""
    visual = getattr(getattr(model, "model", None), "visual", None) or getattr(model, "visual", None)
    if visual is None:
        return []
    blocks = getattr(visual, "blocks", None)
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) == 0:
        raise ValueError(f"{type(model).__name__}: the vision tower {type(visual).__name__} has no blocks "
                         "ModuleList; this vision tower is not supported by the fsdp2 strategy yet")
    merger = getattr(visual, "merger", None)
    return list(blocks) + ([merger] if isinstance(merger, torch.nn.Module) else [])


def shard_model(model: torch.nn.Module, dist: DistInfo, compute_dtype: torch.dtype | None,
                head: HeadSettings = HeadSettings(), compile_layers: bool = False,
                deterministic: bool = False, activation_memory_budget: float = 1.0,
                reshard_after_forward: bool = True) -> torch.nn.Module:
    """fully_shard each vision block and the merger (VL models), each decoder layer, then the root; register
    the log-prob forward method. In place. ``compile_layers`` (train.compile_layers): the language decoder
    layers' forwards run compiled (learner/compiling.py), FSDP2's hooks around them stay eager.
    ``reshard_after_forward=False``: the units keep their gathered weights after forward and backward
    (``FSDP2Strategy`` reshards them at the optimizer step). ``head``: how the log-prob method runs the LM head
    (``HeadSettings.of(train_cfg)``; the default is the plain head, as the frozen reference model runs it)."""
    mesh = init_device_mesh(dist.device.type, (dist.world_size,))
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if compute_dtype is not None and compute_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if compile_layers:
        compile_decoder_layers(decoder_layers(model), deterministic, activation_memory_budget)
    for unit in media_encoder_units(model) + decoder_layers(model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    if not reshard_after_forward:
        for m in fsdp_modules(model):
            m.set_reshard_after_backward(False)
    model.__dict__[LOGPROB_METHOD] = types.MethodType(_logprob_method, model)
    model.__dict__[HEAD_SETTINGS_ATTR] = head
    register_fsdp_forward_method(model, LOGPROB_METHOD)
    return model


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp_unit_names(model: torch.nn.Module) -> list[str]:
    """Module names of the FSDP units of a sharded model, in module order ("" is the root)."""
    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def move_batch(mb: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The microbatch on ``device``. To a GPU, CPU tensors are pinned first: a copy from pageable memory
    waits for all work queued on the stream (CUDA synchronises before it), so each microbatch's inputs
    would stall the host until the previous backward finished; from pinned memory the copy is queued."""
    pin = device.type == "cuda"

    def moved(v: torch.Tensor) -> torch.Tensor:
        if pin and v.device.type == "cpu":
            v = v.pin_memory()
        return v.to(device, non_blocking=True)

    if pin and "head_positions" not in mb and "response_mask" in mb and mb["response_mask"].device.type == "cpu":
        # the LM head's rows from the host copy: found on the GPU, nonzero would wait for the decoder's kernels
        position_ids = mb.get("position_ids")
        mb = {**mb, "head_positions": head_positions(
            mb["response_mask"], position_ids.cpu() if isinstance(position_ids, torch.Tensor) else None)}
    return {k: moved(v) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}


def stats_out(loss: torch.Tensor, metrics: dict, on_device: bool) -> dict:
    """A microbatch's loss and metrics: floats (each a host sync), or with ``on_device`` detached tensors
    the caller sums and reads once per step (no sync between microbatches)."""
    out = {"loss": loss.detach(), **{k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}}
    return out if on_device else {k: float(v) for k, v in out.items()}


def prefix_matches(name: str, prefix: str) -> bool:
    """Whether ``model.freeze_prefix`` entry ``prefix`` covers parameter ``name``: the name starts with it,
    or does once the wrapper segment ``model.`` is dropped. transformers >= 5 nests the towers of a
    conditional-generation model under ``model.`` (``model.visual.blocks.0...``), while configs and older
    checkpoints say ``visual.``; both spellings freeze the same tower."""
    return name.startswith(prefix) or (name.startswith("model.") and name[len("model."):].startswith(prefix))


def store_frozen_in(model: torch.nn.Module, compute_dtype: torch.dtype) -> None:
    """Frozen parameters (a LoRA base, a frozen tower) stored in the compute dtype, not float32: they never
    update, so a float32 master copy only costs memory (7.6B LoRA: 28 GiB of the GPU's 78 GiB peak), and the
    forward sees the same values (MixedPrecisionPolicy casts every parameter to the compute dtype anyway).
    FSDP2 needs one dtype among a group's trainable parameters only. No-op for float32 compute."""
    if compute_dtype == torch.float32:
        return
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(compute_dtype)


def _apply_freeze_prefix(model: torch.nn.Module, prefixes: list[str]) -> None:
    names = [n for n, _ in model.named_parameters()]
    for prefix in prefixes:
        if not any(prefix_matches(n, prefix) for n in names):
            raise ValueError(f"model.freeze_prefix entry {prefix!r} matches no parameter; names look like "
                             f"{names[:3]}; fix or remove the entry")
    for name, p in model.named_parameters():
        if any(prefix_matches(name, prefix) for prefix in prefixes):
            p.requires_grad_(False)


class FSDP2Strategy:
    """The learner backend for one policy model (see the module docstring)."""

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, dist: DistInfo, total_steps: int,
                 model: torch.nn.Module | None = None):
        """``model``: a model already built in place of loading ``model_cfg.path`` (the compile warm-up's one-layer
        copy in the compute dtype, learner/compile_warmup.py); the tokenizer and processor still come from the path."""
        from transformers import AutoTokenizer

        self.rank, self.world_size, self.device = dist.rank, dist.world_size, dist.device
        self.train_cfg = train_cfg
        self.compute_dtype = _DTYPES[model_cfg.dtype]
        if self.compute_dtype != torch.float32 and dist.device.type == "cpu" and model_cfg.dtype == "float16":
            raise ValueError("model.dtype='float16' is not supported on CPU; use 'float32' or 'bfloat16'")
        if model is None:
            model = load_pretrained(model_cfg.path, model_cfg, torch.float32)  # fp32 master weights
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(model_cfg.path, "model.path"))
        from streamrft.models.media_inputs import load_processor
        from streamrft.models.multimodal import check_packing

        self.processor = load_processor(model_cfg.path)  # None for text-only models
        check_packing(model, train_cfg.packing)
        self.model_cfg = model_cfg
        if model_cfg.lora_rank > 0:
            from streamrft.learner.lora import apply_lora

            apply_lora(model, model_cfg)  # before the freeze: adapters under a frozen prefix stay frozen
        _apply_freeze_prefix(model, model_cfg.freeze_prefix)
        store_frozen_in(model, self.compute_dtype)
        if model_cfg.gradient_checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x name
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()  # HF gradient checkpointing is active only in train mode
        # train.reshard_after_forward=false: weights gathered once per optimizer step (release_gathered_weights)
        self.reshard_after_forward = reshard_after_forward_enabled(train_cfg, dist.world_size)
        self.module = shard_model(model, dist, self.compute_dtype, HeadSettings.of(train_cfg),
                                  compile_layers_enabled(train_cfg, dist.device.type),
                                  train_cfg.deterministic, train_cfg.activation_memory_budget,
                                  self.reshard_after_forward).to(self.device)
        for m in fsdp_modules(self.module):
            m.set_gradient_divide_factor(1.0)  # sum over ranks, see the module docstring
            m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
        self.optimizer = build_optimizer(self.module.parameters(), train_cfg)
        self.scheduler = build_lr_scheduler(self.optimizer, train_cfg, total_steps)
        self._rollout_mode = False
        # One rank: a microbatch's gradients are added to the previous ones' float32 accumulators in place of
        # the sharded gradients (the same bytes when nothing is sharded), and reduced once, by the last
        # microbatch before the step: no per-layer reduce in every microbatch. Several ranks: the unsharded
        # accumulators would cost world_size times the sharded gradients' memory, so every backward reduces.
        self.defer_grad_reduce = dist.world_size == 1
        self._unreduced_grads = False  # a forward_backward(last_before_step=False) not yet followed by True

    # ---- compute -------------------------------------------------------------------------------------
    def _logprobs(self, mb, temperature: float, with_entropy: bool):
        if self._rollout_mode:
            raise RuntimeError(f"rank {self.rank}: call reshard_after_rollout() before computing log-probs")
        return getattr(self.module, LOGPROB_METHOD)(move_batch(mb, self.device), temperature, with_entropy)

    @torch.no_grad()
    def compute_logprobs(self, mb: dict[str, torch.Tensor], temperature: float, with_entropy: bool = False):
        """(logp_BL, entropy_BL | None) under the current weights, no grad, float32 on self.device."""
        return self._logprobs(mb, temperature, with_entropy)

    def forward_backward(self, mb: dict[str, torch.Tensor], loss_fn: LossFn, temperature: float,
                         with_entropy: bool = False, stats_on_device: bool = False,
                         last_before_step: bool = True) -> dict[str, float]:
        """Accumulate d(loss)/dθ for one microbatch; ``loss_fn(mb, logp_BL, entropy_BL) -> (loss, metrics)``.

        ``loss`` must already be normalised by global counts; gradients are summed over ranks and
        microbatches. Returns {"loss": ..., **metrics} as floats (``stats_on_device``: detached tensors, see
        ``stats_out``). ``last_before_step=False`` on one rank: the gradients stay in the units' float32
        accumulators and are reduced into the sharded parameters by the next call with True (module docstring).
        """
        if self.defer_grad_reduce:
            self.module.set_requires_gradient_sync(last_before_step)
            self._unreduced_grads = not last_before_step
        mb = move_batch(mb, self.device)
        logp_BL, entropy_BL = self._logprobs(mb, temperature, with_entropy)
        loss, metrics = loss_fn(mb, logp_BL, entropy_BL)
        if loss.dim() != 0:
            raise ValueError(f"loss_fn returned a loss of shape {tuple(loss.shape)}; it must return a scalar")
        loss.backward()
        return stats_out(loss, metrics, stats_on_device)

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of all trainable gradients (a plain tensor, the same on every rank)."""
        self._check_reduced()
        self.release_gathered_weights()  # gathered parameters have no .grad: the sharded ones hold it
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        if all(isinstance(g, DTensor) and g.device_mesh.ndim == 1 and g.placements[0].is_shard() for g in grads):
            # each rank's shards are disjoint pieces: their squared norms add up over the mesh. On the local
            # tensors, as in ShardLocalAdamW (learner/optim.py): DTensor's sharding propagation of the foreach
            # norm cost 0.1-0.15 s of host time on the steps its cache missed (0.5B, H200)
            local = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([g._local_tensor for g in grads])))
            squared = local.float().square()
            torch.distributed.all_reduce(squared, group=grads[0].device_mesh.get_group())
            return squared.sqrt()
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def step(self) -> dict[str, float]:
        """Clip to train.grad_clip by the global grad norm, AdamW step, LR schedule step, zero grads.

        A non-finite grad norm skips the AdamW update (the schedule still advances); the caller sees it
        in the returned grad_norm and decides whether to stop."""
        norm = self.grad_norm()  # first: it checks the gradients were reduced and frees the gathered weights
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.train_cfg.grad_clip > 0 and params:
            torch.nn.utils.clip_grads_with_norm_(params, self.train_cfg.grad_clip, norm)
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm = float(norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "lr": lr}

    def _check_reduced(self) -> None:
        if self._unreduced_grads:
            raise RuntimeError(f"rank {self.rank}: the last forward_backward before the optimizer step passed "
                               "last_before_step=False, so its gradients were never reduced into the parameters; "
                               "pass last_before_step=True for the last microbatch of each step")

    def release_gathered_weights(self) -> None:
        """Free the weights that train.reshard_after_forward=false kept gathered since the last optimizer step
        (a no-op for units already resharded), so that ``module.parameters()`` are the sharded parameters again,
        which hold the gradients. Before anything that changes or reads the sharded weights or their gradients:
        the optimizer step, the grad norm, a load, a save, moving them between devices, the engine's copy."""
        if not self.reshard_after_forward and not self._rollout_mode:
            for m in fsdp_modules(self.module):
                m.reshard()

    # ---- colocated rollout ---------------------------------------------------------------------------
    def unshard_for_rollout(self) -> None:
        """Gather full parameters and keep them: ``self.module`` then runs any number of forwards (e.g.
        ``generate``) with no collectives, so ranks may run different numbers of forwards."""
        modules = fsdp_modules(self.module)
        self.module.unshard()  # the root first: its lazy init must precede the layers'
        for m in modules:
            m.set_reshard_after_forward(False)
            m.unshard()
        self._rollout_mode = True

    def reshard_after_rollout(self) -> None:
        for m in fsdp_modules(self.module):
            m.reshard()
            m.set_reshard_after_forward(self.reshard_after_forward)
        self._rollout_mode = False

    # ---- memory --------------------------------------------------------------------------------------
    def offload(self) -> None:
        """Move sharded params and optimizer state to CPU (a no-op when training on CPU)."""
        self.release_gathered_weights()
        self._move_to(torch.device("cpu"))

    def reload(self) -> None:
        """Bring sharded params and optimizer state back to self.device (a no-op on CPU)."""
        self._move_to(self.device)

    def _move_to(self, device: torch.device) -> None:
        move_module_and_optimizer(self.module, self.optimizer, device, self.device)

    # ---- weights out ---------------------------------------------------------------------------------
    def full_state_for_engine(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full (unsharded) weights in HF state-dict names, in buckets of about ``bucket_bytes``.

        A collective: every rank must drain the iterator. Tensors are in model.dtype on self.device.
        """
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
        self.release_gathered_weights()
        named = ((n, v.full_tensor() if isinstance(v, DTensor) else v) for n, v in self.module.state_dict().items())
        if self.model_cfg.lora_rank > 0:
            from streamrft.learner.lora import lora_scaling, merge_lora_named_tensors

            named = merge_lora_named_tensors(named, lora_scaling(self.model_cfg))  # adapters folded in
        cast = ((n, t.to(self.compute_dtype) if t.is_floating_point() else t) for n, t in named)
        yield from bucketed(cast, bucket_bytes)

    # ---- checkpoints ---------------------------------------------------------------------------------
    def state_for_save(self) -> dict:
        """What ``save`` writes (views of the live state; checkpoint/staging.py copies it for async saves)."""
        self.release_gathered_weights()
        return sharded_state(self.module, self.optimizer, self.scheduler)

    def save(self, path: str) -> None:
        """Sharded model + optimizer + scheduler state with torch.distributed.checkpoint (all ranks call)."""
        dcp.save(self.state_for_save(), checkpoint_id=path)

    def load(self, path: str) -> None:
        """Restore what ``save`` wrote (all ranks call, same world size or resharded by DCP), reading no
        pickled code from the folder (checkpoint/safe_load.py)."""
        self.release_gathered_weights()
        load_sharded_state(path, self.module, self.optimizer, self.scheduler, "checkpoint path", self.rank)
