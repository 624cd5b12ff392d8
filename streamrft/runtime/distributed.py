"""Process-group setup and the few collectives the learner needs, each with a timeout that names its stage.

Design choice for world size 1 (no torchrun env vars): we still create a one-rank gloo group, backed by an
in-process ``HashStore`` (no port, no network), so FSDP2 and every collective run the same code path at any
world size. With CUDA the group is NCCL for CUDA tensors and gloo for CPU tensors (``cpu:gloo,cuda:nccl``):
the learner's collectives run on the GPU, while the driver's small agreements and statistics are CPU tensors,
which a NCCL-only group rejects at world size > 1; without CUDA it is gloo.

Every collective here runs with ``async_op=True`` and waits with an explicit timeout; a timeout or a lost
peer ends in :class:`CollectiveError` naming the stage and the rank. (Under NCCL, ``wait`` only orders the
CUDA stream; the deadline is then enforced by the NCCL watchdog using ``init_process_group(timeout=...)``.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_DEFAULT_TIMEOUT_S = 600.0
_timeout_s: float = _DEFAULT_TIMEOUT_S


class CollectiveError(RuntimeError):
    """A collective that did not complete: names the stage, the rank and the timeout."""


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device  # where this rank computes: cuda:<local_rank> or cpu
    backend: str  # "nccl" | "gloo"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer; launch with torchrun") from None


def init_distributed(timeout_s: float = _DEFAULT_TIMEOUT_S) -> DistInfo:
    """Join (or create) the default process group and return this rank's place in it.

    Reads RANK, WORLD_SIZE, LOCAL_RANK (set by torchrun). Without them: world size 1 on a private
    in-process gloo group. Idempotent: a second call returns the existing group's info.
    """
    global _timeout_s
    if timeout_s <= 0:
        raise ValueError(f"init_distributed(timeout_s={timeout_s}) must be > 0 seconds")
    rank, world_size, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    use_cuda = torch.cuda.is_available()
    group_backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        _timeout_s = float(timeout_s)
        timeout = timedelta(seconds=timeout_s)
        if rank is None or world_size is None:
            store = dist.HashStore()
            dist.init_process_group(group_backend, store=store, rank=0, world_size=1, timeout=timeout)
        else:
            if local_rank is None:
                raise ValueError(f"RANK={rank} is set but LOCAL_RANK is not; launch with torchrun")
            if use_cuda:
                torch.cuda.set_device(local_rank)
            dist.init_process_group(group_backend, timeout=timeout)
    backend = "nccl" if "nccl" in str(dist.get_backend()).lower() else "gloo"  # of the group, this call's or earlier
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = local_rank if local_rank is not None else 0
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend)


def _wait(work, stage: str, timeout_s: float | None) -> None:
    timeout = _timeout_s if timeout_s is None else timeout_s
    rank = dist.get_rank()
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:  # gloo raises on timeout or on a peer that went away
        raise CollectiveError(
            f"collective '{stage}' failed on rank {rank} (timeout {timeout:g}s): {exc}; "
            f"another rank probably skipped '{stage}' or died; check its log") from exc
    if ok is False:
        raise CollectiveError(f"collective '{stage}' timed out on rank {rank} after {timeout:g}s")


def all_reduce_sum(t: torch.Tensor, stage: str = "all_reduce_sum", timeout_s: float | None = None) -> torch.Tensor:
    """Return the elementwise sum of ``t`` over ranks (a new tensor; ``t`` is untouched)."""
    return _all_reduce(t, dist.ReduceOp.SUM, stage, timeout_s)


def all_reduce_max(t: torch.Tensor, stage: str = "all_reduce_max", timeout_s: float | None = None) -> torch.Tensor:
    """Return the elementwise max of ``t`` over ranks (a new tensor; ``t`` is untouched)."""
    return _all_reduce(t, dist.ReduceOp.MAX, stage, timeout_s)


def _all_reduce(t: torch.Tensor, op, stage: str, timeout_s: float | None) -> torch.Tensor:
    out = t.detach().clone()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return out
    _wait(dist.all_reduce(out, op=op, async_op=True), stage, timeout_s)
    return out


def barrier(name: str, timeout_s: float | None = None) -> None:
    """Wait until every rank reaches the barrier ``name``; CollectiveError names it and the rank on timeout."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    # an all-reduce of one CPU element (gloo in every group: init_distributed) is a barrier whose wait honours
    # the timeout
    token = torch.zeros(1)
    _wait(dist.all_reduce(token, async_op=True), f"barrier:{name}", timeout_s)


def destroy_distributed() -> None:
    """Tear down the default process group (no-op when none exists)."""
    if dist.is_initialized():
        dist.destroy_process_group()
