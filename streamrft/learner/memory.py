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
