from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from streamrft.config.base import Section

HEAD_KERNELS = ("fused", "checkpoint")  # train.head_kernel's values (learner/logprobs.py dispatches on them)
# each head kernel's own chunk (train.head_chunk_tokens=auto): tokens per (chunk, vocabulary) block. Eagerly the
# fused kernel peaks at ~2 float32 blocks and the checkpointed one at ~5 (benchmarks/head_bench.py, CPU: 2.1 vs
# 5.1); compiled, fused holds the head output and dZ in bf16. Larger chunks mean fewer, larger GEMMs
HEAD_KERNEL_CHUNKS = {"fused": 4096, "checkpoint": 1024}


class TrainConfig(Section):
    max_steps: int = 100  # train steps (one optimizer step per mini-batch per step)
    strategy: Literal["fsdp2", "deepspeed"] = "fsdp2"  # learner backend
    zero_stage: Literal[1, 2, 3] = 3  # DeepSpeed ZeRO stage when train.strategy=deepspeed
    packing: bool = False  # pack sequences into one row per microbatch (block-diagonal attention)
    critic_lr: float = 1e-5  # AdamW lr of the critic (value model) when model.critic_path is set
    lr: float = 1e-5
    lr_schedule: Literal["constant", "cosine"] = "constant"  # cosine includes linear warm-up
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    micro_batch_tokens: int = 8192  # token budget of one forward/backward microbatch
    mini_batches_per_step: int = 1  # optimizer steps per train step (PPO mini-batches)
    ppo_epochs: int = 1  # passes over the step's samples
    eval_every: int = 0  # evaluate every N steps; 0 = before and after only
    log_every: int = 1
    compile_head: bool = True  # torch.compile the chunked LM-head log-prob/entropy (CUDA only; CPU runs eagerly)
    # torch.compile each decoder layer (one shared graph, rows and tokens symbolic; Inductor's Triton backend on CUDA,
    # C++ on CPU); FSDP2 only. auto = on for fsdp2 on a GPU (H200, 0.5B: train step 3.84 -> 3.13 s, peak -9.3 GiB; the
    # first step pays the compile, cached by compile_cache_dir), off on CPU (Inductor's C++ compile costs more than it
    # saves at CPU sizes); true compiles on CPU too
    compile_layers: Union[Literal["auto"], bool] = "auto"
    # a child process compiles the learner's graphs on a one-layer copy of the model while the run starts (config
    # checks, model load, engine set-up, first rollout), filling compile_cache_dir's caches so the first train step
    # finds them warm (learner/compile_warmup.py); fsdp2 with text models. auto = on where the learner compiles on a
    # GPU (off on a CPU: on 2 cores the child only competes with the run, benchmarks/NOTES.md v17); true = wherever
    # the learner compiles (train.compile_layers, train.compile_head), an error elsewhere
    compile_warmup: Union[Literal["auto"], bool] = "auto"
    # fsdp2: false keeps each layer's gathered compute-dtype weights from its first forward of an optimizer step to
    # that step's last backward (gathered once per step, not twice per microbatch: the per-layer copies and their
    # host-side launches go), at the cost of the whole model's compute-dtype weights on every rank during training
    # (0.5B: 1 GiB, 7B: 15 GiB). auto = false on one rank (there is nothing to shard: the gather is only a cast
    # copy), true on several
    reshard_after_forward: Union[Literal["auto"], bool] = "auto"
    # compiled decoder layers only: the fraction (0..1) of the layer graph's backward activations kept; below 1,
    # torch.compile's partitioner recomputes the cheapest of the rest in backward (0 = layer inputs only, as
    # model.gradient_checkpointing). benchmarks/NOTES.md v12: peak memory against train time on the H200
    activation_memory_budget: float = 1.0
    head_kernel: Literal["fused", "checkpoint"] = "fused"  # LM-head log-prob/entropy: fused (analytic backward, 4096-row chunks) or checkpoint (autograd, 1024-row chunks)
    # response tokens per chunk of the LM head's (tokens, vocabulary) blocks, forward and backward; auto = the head
    # kernel's own (fused 4096, checkpoint 1024). The head's backward runs first, while every layer's activations
    # are held: at vocabulary 151936 the compiled fused backward holds two bf16 blocks of 1.16 GiB each at 4096, so
    # a smaller chunk lowers the train step's peak (benchmarks/NOTES.md v23)
    head_chunk_tokens: Union[Literal["auto"], int] = "auto"
    deterministic: bool = False  # torch.use_deterministic_algorithms for bitwise resume checks
    record_batches: bool = False  # save every step's batch under output_dir/batches/ for `streamrft replay`
    # fsdp2: AdamW's exp_avg/exp_avg_sq in pinned host memory, streamed through the device one parameter at a time
    # in each step (learner/host_adamw.py): 8 bytes/parameter off the GPU (57 GiB at 7.6B) for full fine-tuning
    optimizer_offload: bool = False
    # AdamW as one fused kernel per parameter group (torch's fused=True) instead of torch's default foreach ops,
    # whose step holds one more parameter-sized float32 temporary (the square root of exp_avg_sq) at its peak;
    # the same update up to float rounding. Not with optimizer_offload (its per-parameter stream is its own)
    fused_adamw: bool = False
    offload_between_phases: bool = True  # colocated: move optimizer state (and params) to host memory during rollout; false keeps them on the device (faster switch when memory allows)


def compile_head_enabled(compile_head: bool, device_type: str) -> bool:
    """train.compile_head resolved for a learner on ``device_type``: the LM head compiles on CUDA only."""
    return compile_head and device_type == "cuda"


def head_chunk_size(cfg: TrainConfig) -> int | None:
    """train.head_chunk_tokens resolved: auto is train.head_kernel's own chunk (``HEAD_KERNEL_CHUNKS``); None for
    an unknown head kernel, which the head then refuses by its key (learner/logprobs.py)."""
    if cfg.head_chunk_tokens == "auto":
        return HEAD_KERNEL_CHUNKS.get(cfg.head_kernel)
    return int(cfg.head_chunk_tokens)


@dataclass(frozen=True)
class HeadSettings:
    """The policy's LM-head settings, resolved once from train.* (``of``) and handed whole to the learner's
    log-prob forward (``learner.logprobs.head_logprobs``): one value, so a strategy or the warm-up child cannot
    pass one setting and forget another. The defaults are the plain head: eager, fused, the kernel's own chunk."""

    compile_head: bool = False  # train.compile_head (still CUDA only: compile_head_enabled)
    kernel: str = "fused"  # train.head_kernel
    chunk_tokens: int | None = None  # train.head_chunk_tokens resolved (head_chunk_size); None: the kernel's own

    @classmethod
    def of(cls, cfg: TrainConfig) -> "HeadSettings":
        return cls(cfg.compile_head, cfg.head_kernel, head_chunk_size(cfg))


def reshard_after_forward_enabled(cfg: TrainConfig, world_size: int) -> bool:
    """train.reshard_after_forward resolved for a learner of ``world_size`` ranks."""
    if cfg.reshard_after_forward == "auto":
        return world_size > 1
    return bool(cfg.reshard_after_forward)


def compile_layers_enabled(cfg: TrainConfig, device_type: str) -> bool:
    """train.compile_layers resolved for a learner on ``device_type`` ("cuda" | "cpu")."""
    if cfg.compile_layers == "auto":
        return cfg.strategy == "fsdp2" and device_type == "cuda"
    return bool(cfg.compile_layers)


def compile_warmup_enabled(cfg: TrainConfig, device_type: str) -> bool:
    """train.compile_warmup resolved for a learner on ``device_type``: only where the learner compiles (fsdp2)."""
    compiles = compile_layers_enabled(cfg, device_type) or compile_head_enabled(cfg.compile_head, device_type)
    wanted = cfg.compile_warmup is True or (cfg.compile_warmup == "auto" and device_type == "cuda")
    return wanted and cfg.strategy == "fsdp2" and compiles
