"""The DeepSpeed ZeRO strategy (train.strategy=deepspeed, train.zero_stage=1|2|3), FSDP2Strategy's twin.

ZeRO (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models")
partitions optimizer state (stage 1), + gradients (stage 2), + parameters (stage 3) over data-parallel
ranks. The optimizer is torch AdamW from ``optim.build_optimizer`` passed as a client optimizer (no fused
Adam JIT build), the LR schedule is ``optim.build_lr_scheduler``; on CPU it runs on gloo
(``DS_ACCELERATOR=cpu`` is set before deepspeed is imported when CUDA is absent).

Gradient convention (the same as fsdp2.py): the caller's loss is already normalised by *global* counts,
and the gradient we want is d/dθ sum_ranks loss_rank, accumulated (summed) over microbatches. DeepSpeed
averages gradients over the data-parallel group, so we backpropagate ``world_size * loss``; we run with
``managed_gradient_accumulation: false`` so a step may hold any number of microbatches (every
``backward`` accumulates, ``step()`` is the boundary) and with ``backward(scale_wrt_gas=False)``.
Clipping is DeepSpeed's ``gradient_clipping`` on the global norm (train.grad_clip; 0 = off), and the
returned grad_norm is the norm before clipping, as in FSDP2. As with FSDP2 every rank must call
forward_backward the same number of times per step (stage 2/3 reduce inside each backward). Unlike
FSDP2, a non-finite grad norm is left to DeepSpeed (in float32 it still steps).

The log-prob forward runs inside a wrapper module (``_LogprobModel``) whose forward calls
``logprobs.token_logprobs``: the chunked LM head uses ``lm_head.weight`` outside the head's own
forward, so under ZeRO-3 that weight is registered as an external parameter of the wrapper and is
gathered for the whole forward and backward.

Colocated rollout under ZeRO-3: ``unshard_for_rollout`` gathers every parameter (one collective, all
ranks) and removes the ZeRO-3 module hooks, so ``self.module`` (the HF model the engine holds) runs any
number of forwards with no collectives; ``reshard_after_rollout`` re-partitions and reinstalls the hooks.
Full parameters are then alive on every rank during rollout, as with FSDP2's unshard. Stages 1/2 keep
full parameters anyway; both calls only set the rollout flag there.
"""

from __future__ import annotations

import os
import sys
from contextlib import ExitStack
from typing import TYPE_CHECKING, Iterator

import torch

from streamrft.config.train import HeadSettings
from streamrft.learner.base import LossFn
from streamrft.learner.fsdp2 import _DTYPES, _apply_freeze_prefix, load_pretrained, move_batch, stats_out
from streamrft.learner.logprobs import head_logprobs
from streamrft.learner.lora import apply_lora, lora_scaling, merge_lora_named_tensors
from streamrft.learner.optim import build_lr_scheduler, build_optimizer
from streamrft.models.hub import resolve_model_dir

if TYPE_CHECKING:
    from streamrft.config.model import ModelConfig
    from streamrft.config.train import TrainConfig
    from streamrft.runtime.distributed import DistInfo

CKPT_TAG = "streamrft"  # the DeepSpeed checkpoint tag under the save path


def _import_deepspeed(dist: DistInfo):
    """Import deepspeed for this rank. On CPU: DS_ACCELERATOR=cpu, and DeepSpeed's shared-memory
    all-reduce op (used only by its inference all-reduce) is not JIT-built (a C++ build of minutes)."""
    if dist.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(dist.local_rank))  # set by torchrun; world size 1 runs without it
    try:
        import deepspeed
        import deepspeed.comm.torch  # noqa: F401  (``deepspeed.comm.torch`` the attribute is torch itself)
    except ImportError as e:
        raise ValueError("train.strategy='deepspeed' needs the deepspeed package: "
                         "DS_BUILD_OPS=0 pip install deepspeed (or set train.strategy=fsdp2)") from e
    if dist.device.type == "cpu":
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    return deepspeed


class _LogprobModel(torch.nn.Module):
    """Holds the policy; forward = token_logprobs(policy, mb, ...), so ZeRO hooks wrap all of it."""

    def __init__(self, policy: torch.nn.Module, head: HeadSettings = HeadSettings()):
        super().__init__()
        self.policy = policy
        self.head = head  # HeadSettings.of(train_cfg)

    def forward(self, mb: dict[str, torch.Tensor], temperature: float, with_entropy: bool):
        return head_logprobs(self.policy, mb, temperature, with_entropy, self.head)


def ds_config(model_cfg: ModelConfig, train_cfg: TrainConfig) -> dict:
    """The DeepSpeed config dict for these settings (see the module docstring)."""
    if train_cfg.zero_stage not in (1, 2, 3):
        raise ValueError(f"train.zero_stage={train_cfg.zero_stage} must be 1, 2 or 3")
    zero = {"stage": train_cfg.zero_stage, "overlap_comm": False, "contiguous_gradients": False}
    if train_cfg.zero_stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=int(1e9),
                    stage3_prefetch_bucket_size=0)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(train_cfg.grad_clip),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": model_cfg.dtype == "bfloat16"},
        "fp16": {"enabled": model_cfg.dtype == "float16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class DeepSpeedStrategy:
    """The learner backend for one policy model on DeepSpeed ZeRO (see the module docstring)."""

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, dist: DistInfo, total_steps: int):
        from transformers import AutoTokenizer

        self.ds = _import_deepspeed(dist)
        self.rank, self.world_size, self.device = dist.rank, dist.world_size, dist.device
        self.model_cfg, self.train_cfg = model_cfg, train_cfg
        self.compute_dtype = _DTYPES[model_cfg.dtype]
        if model_cfg.dtype != "float32" and dist.device.type == "cpu":
            raise ValueError(f"model.dtype={model_cfg.dtype!r} with train.strategy='deepspeed' is not supported "
                             "on CPU; use model.dtype='float32'")
        self.zero_stage = train_cfg.zero_stage
        config = ds_config(model_cfg, train_cfg)
        model = load_pretrained(model_cfg.path, model_cfg, torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(model_cfg.path, "model.path"))
        apply_lora(model, model_cfg)
        _apply_freeze_prefix(model, model_cfg.freeze_prefix)
        if model_cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        model.train()
        self.module = model.to(self.device)  # the HF model: what engines and callers see
        wrapper = _LogprobModel(self.module, HeadSettings.of(train_cfg))
        if self.zero_stage == 3:
            head = self.module.get_output_embeddings()
            self.ds.zero.register_external_parameter(wrapper, head.weight)
        self.ds.init_distributed(dist_backend=dist.backend, verbose=False)
        optimizer = build_optimizer([p for p in wrapper.parameters() if p.requires_grad], train_cfg)
        self.engine, self.optimizer, _, self.scheduler = self.ds.initialize(
            model=wrapper, optimizer=optimizer, config=config,
            lr_scheduler=lambda opt: build_lr_scheduler(opt, train_cfg, total_steps),
        )
        self._rollout_mode = False
        self._gathered: ExitStack | None = None

    # ---- compute -------------------------------------------------------------------------------------
    def _logprobs(self, mb, temperature: float, with_entropy: bool):
        if self._rollout_mode:
            raise RuntimeError(f"rank {self.rank}: call reshard_after_rollout() before computing log-probs")
        return self.engine(move_batch(mb, self.device), temperature, with_entropy)

    @torch.no_grad()
    def compute_logprobs(self, mb: dict[str, torch.Tensor], temperature: float, with_entropy: bool = False):
        """(logp_BL, entropy_BL | None) under the current weights, no grad, float32 on self.device."""
        return self._logprobs(mb, temperature, with_entropy)

    def forward_backward(self, mb: dict[str, torch.Tensor], loss_fn: LossFn, temperature: float,
                         with_entropy: bool = False, stats_on_device: bool = False,
                         last_before_step: bool = True) -> dict[str, float]:
        """Accumulate d(loss)/dθ for one microbatch, summed over ranks (see the module docstring).
        ``last_before_step`` is not needed here: DeepSpeed's engine keeps its own accumulation boundary."""
        mb = move_batch(mb, self.device)
        logp_BL, entropy_BL = self._logprobs(mb, temperature, with_entropy)
        loss, metrics = loss_fn(mb, logp_BL, entropy_BL)
        if loss.dim() != 0:
            raise ValueError(f"loss_fn returned a loss of shape {tuple(loss.shape)}; it must return a scalar")
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)  # DeepSpeed averages over ranks
        return stats_out(loss, metrics, stats_on_device)

    def step(self) -> dict[str, float]:
        """Clip (DeepSpeed gradient_clipping), AdamW step, LR schedule step, zero grads."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else 0.0
        return {"grad_norm": norm, "lr": lr}

    # ---- colocated rollout ---------------------------------------------------------------------------
    def unshard_for_rollout(self) -> None:
        """ZeRO-3: gather all parameters and lift the module hooks (a collective); see the docstring."""
        if self.zero_stage == 3:
            params = list(self.module.parameters())
            self._gathered = ExitStack()
            self._gathered.enter_context(self.ds.zero.GatheredParameters(params, modifier_rank=None))
            self.engine.optimizer.parameter_offload._remove_module_hooks()
        self._rollout_mode = True

    def reshard_after_rollout(self) -> None:
        if self.zero_stage == 3 and self._gathered is not None:
            self._gathered.close()  # re-partitions the parameters
            self._gathered = None
            self.engine.optimizer.parameter_offload.setup_zero_stage3_hooks()
        self._rollout_mode = False

    # ---- memory --------------------------------------------------------------------------------------
    def offload(self) -> None:
        """Move ZeRO partitions (params, grads, optimizer state) to CPU (a no-op when training on CPU)."""
        if self.device.type != "cpu":
            self.engine.offload_states()

    def reload(self) -> None:
        if self.device.type != "cpu":
            self.engine.reload_states()

    # ---- weights out ---------------------------------------------------------------------------------
    def _full_named(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.module.state_dict(keep_vars=True).items():
            if hasattr(t, "ds_id"):
                with self.ds.zero.GatheredParameters([t], modifier_rank=None):
                    full = t.detach().clone()
            else:
                full = t.detach()
            yield name, full.to(self.compute_dtype) if full.is_floating_point() else full

    def full_state_for_engine(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full weights in HF state-dict names (LoRA merged in), in buckets of about ``bucket_bytes``.

        A collective under ZeRO-3: every rank must drain the iterator."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
        named = self._full_named()
        if self.model_cfg.lora_rank > 0:
            named = merge_lora_named_tensors(named, lora_scaling(self.model_cfg))
        from streamrft.learner.memory import bucketed

        yield from bucketed(named, bucket_bytes)

    # ---- checkpoints ---------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """DeepSpeed checkpoint (partitioned model + optimizer + scheduler) under ``path`` (all ranks call)."""
        self.engine.save_checkpoint(path, tag=CKPT_TAG)

    def load(self, path: str) -> None:
        if not os.path.isdir(os.path.join(path, CKPT_TAG)):
            raise ValueError(f"checkpoint path {path!r} (rank {self.rank}) holds no DeepSpeed checkpoint "
                             f"'{CKPT_TAG}'; check checkpoint.resume")
        load_path, _ = self.engine.load_checkpoint(path, tag=CKPT_TAG, load_optimizer_states=True,
                                                   load_lr_scheduler_states=True)
        if load_path is None:
            raise ValueError(f"DeepSpeed could not load checkpoint {path!r} (rank {self.rank})")
