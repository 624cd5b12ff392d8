"""Shared by the learner backends: moving state between host and device, and weight buckets."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch


def move_module_and_optimizer(module: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                              home: torch.device) -> None:
    """Move parameters and optimizer state to ``device`` (offload to CPU, reload to ``home``).

    A no-op when training on CPU (``home`` is the CPU): there is nowhere else to put them. The
    optimizer's ``step`` counters stay where they are (they are CPU scalars by design)."""
    if home.type == "cpu":
        return
    module.to(device)
    if getattr(optimizer, "keeps_state_on_host", False):  # train.optimizer_offload: the moments never move
        torch.cuda.synchronize()
        if device.type == "cpu":
            torch.cuda.empty_cache()
        return
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
    torch.cuda.synchronize()
    if device.type == "cpu":
        torch.cuda.empty_cache()  # give the freed memory to the rollout engine


def bucketed(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into buckets of about ``bucket_bytes`` (a bucket closes once it
    reaches the size, so one large tensor makes a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def out_of_memory_advice(cfg, rank: int, world_size: int, device_type: str, largest_microbatch_tokens: int,
                         peak_bytes: int, total_bytes: int) -> str:
    """What a train step that ran out of device memory says: the rank, the microbatch, the device's peak against
    its size, and the settings that lower the learner's peak which this run has not set yet, cheapest first
    (benchmarks/NOTES.md v21-v22 measured each one's cost in speed). Why a message of its own: CUDA's names the
    bytes it could not allocate and the allocator's fragmentation, not which of the run's settings to change.
    ``cfg``: the run's Config."""
    from streamrft.config.train import compile_layers_enabled, head_chunk_size, reshard_after_forward_enabled

    t = cfg.train
    options = [f"train.micro_batch_tokens (now {t.micro_batch_tokens}; the peak's activations scale with it)"]
    chunk = head_chunk_size(t)
    if chunk > 1024:  # below, the head's GEMMs get small for what they save
        options.append(f"train.head_chunk_tokens={chunk // 2} (now {chunk}; the LM head's (tokens, vocabulary) "
                       "blocks, held beside every layer's activations when the backward starts)")
    if t.strategy == "fsdp2" and compile_layers_enabled(t, device_type) and t.activation_memory_budget >= 1.0:
        options.append("train.activation_memory_budget=0.5 (the compiled layers recompute part of their activations)")
    if t.strategy == "fsdp2" and not reshard_after_forward_enabled(t, world_size):
        options.append("train.reshard_after_forward=true (the gathered compute-dtype weights are not kept)")
    if not cfg.model.gradient_checkpointing:
        options.append("model.gradient_checkpointing=true")
    if t.strategy == "fsdp2" and not t.optimizer_offload:
        options.append("train.optimizer_offload=true (the AdamW moments in host memory: 8 bytes a parameter)")
    gib = 1024 ** 3
    return (f"rank {rank}: the train step ran out of {device_type} memory in a microbatch of up to "
            f"{largest_microbatch_tokens} tokens (peak {peak_bytes / gib:.1f} GiB allocated of the device's "
            f"{total_bytes / gib:.1f} GiB). Settings that lower the learner's peak: " + "; ".join(options) + ".")
