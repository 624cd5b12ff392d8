"""Host memory for checkpoint staging, page-locked without holding up the training thread.

Why not ``torch.empty(..., pin_memory=True)``: it calls cudaHostAlloc, which faults in and page-locks the
whole allocation while holding the CUDA driver's lock (and PyTorch's host allocator rounds each request up
to a power of two). Made by the stager's background prewarm, every CUDA call of the training thread waited
behind it: on the H200 the first switch back to rollout after the first train step took 4.2 s at 0.5B
(~6 GB of fp32 weights and Adam state) and 11.8 s at 1.5B, against 0.02 s in every later step
(benchmarks/NOTES.md v11).

A ``HostSlab`` is one page-aligned block of ordinary host memory, carved into one buffer per tensor. It is
page-locked one chunk of whole buffers at a time (~256 MiB, or one larger buffer): each chunk's pages are
first touched by a plain fill (no CUDA call, so no driver lock), then locked in place with cudaHostRegister,
so a CUDA call of another thread waits for one chunk at most. ``pace`` is called before each chunk with the
previous chunk's locking seconds: the stager's prewarm uses it to lock only while the rollout decodes and
to leave the driver to the decode loop between chunks (runtime/host_idle.py). If the driver refuses (a
locked-memory limit, a container without the capability), the slab stays ordinary memory: device-to-host
copies are then synchronous and slower, still correct, and a warning says so.
"""

from __future__ import annotations

import resource
import time
import warnings
import weakref
from typing import Callable, Sequence

import torch

ALIGN = 64  # bytes between buffers: every dtype's alignment, and a cache line
CHUNK_BYTES = 256 << 20  # page-locked per driver call: a few tens of ms each
PAGE = resource.getpagesize()

Register = Callable[[int, int], "str | None"]  # (address, bytes) -> None, or the driver's error text
Unregister = Callable[[int], None]
Pace = Callable[[float], None]  # called before each chunk with the previous chunk's locking seconds


def layout(specs: Sequence[tuple[torch.Size, torch.dtype]],
           chunk_bytes: int = CHUNK_BYTES) -> tuple[list[int], list[tuple[int, int]], int]:
    """Where each (shape, dtype) buffer goes in a slab, and how the slab is page-locked.

    Returns the buffers' byte offsets (ALIGN apart), the lock chunks as (offset, bytes), and the slab's size.
    A chunk holds whole buffers only, at most chunk_bytes of them (a larger buffer is a chunk by itself),
    starts on a page and ends on one: the driver treats each registration as one allocation, and a copy
    whose host range crosses from one registration into the next fails (cudaErrorInvalidValue on the H200),
    while two registrations sharing a page would be refused."""
    offsets: list[int] = []
    runs: list[tuple[int, int]] = []
    run_start, end = 0, 0
    for shape, dtype in specs:
        nbytes = _nbytes(shape, dtype)
        aligned = -(-end // ALIGN) * ALIGN
        if aligned > run_start and aligned + nbytes - run_start > chunk_bytes:
            runs.append((run_start, _pages(end) - run_start))  # close this chunk; the buffer starts the next
            run_start = aligned = _pages(end)
        offsets.append(aligned)
        end = aligned + nbytes
    total = max(PAGE, _pages(end))
    runs.append((run_start, total - run_start))
    return offsets, runs, total


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


class HostSlab:
    """One page-aligned block of host memory holding a buffer per (shape, dtype) spec (``views``), its
    pages touched, and page-locked when ``pin`` (``pinned`` says whether that worked). The pages are
    unlocked when the slab is collected; the views keep the memory itself alive after that."""

    def __init__(self, specs: Sequence[tuple[torch.Size, torch.dtype]], pin: bool, register: Register | None = None,
                 unregister: Unregister | None = None, chunk_bytes: int = CHUNK_BYTES, rank: int = 0,
                 pace: Pace | None = None):
        offsets, runs, total = layout(specs, chunk_bytes)
        raw = torch.empty(total + PAGE, dtype=torch.uint8)
        start = (-raw.data_ptr()) % PAGE
        self.memory = raw[start:start + total]
        self.nbytes = total
        self.views = [self.memory[o:o + _nbytes(shape, dtype)].view(dtype).view(shape)
                      for o, (shape, dtype) in zip(offsets, specs)]
        self.pinned = False
        if pin:
            self.pinned = self._lock(register or cuda_register, unregister or cuda_unregister, runs, rank, pace)
        else:
            self.memory.zero_()  # first touch of every page here, not in the first save's copy

    def _lock(self, register: Register, unregister: Unregister, runs: list[tuple[int, int]], rank: int,
              pace: Pace | None) -> bool:
        locked: list[int] = []
        base = self.memory.data_ptr()
        held = 0.0
        for offset, nbytes in runs:
            if pace is not None:
                pace(held)
            self.memory[offset:offset + nbytes].zero_()  # first touch of the chunk's pages, outside any CUDA call
            address = base + offset
            started = time.perf_counter()
            error = register(address, nbytes)
            held = time.perf_counter() - started
            if error is not None:
                for done in locked:
                    unregister(done)
                self.memory[offset + nbytes:].zero_()  # the chunks after this one touched all the same
                warnings.warn(f"checkpoint staging on rank {rank}: page-locking {self.nbytes} bytes of host memory "
                              f"failed ({error}); saves copy from the GPU through pageable memory (slower)",
                              RuntimeWarning, stacklevel=3)
                return False
            locked.append(address)
        # unlocked before the memory can be freed: weakref callbacks run before the slab's attributes go
        weakref.finalize(self, _unlock_all, locked, unregister).atexit = False
        return True


def cuda_register(address: int, nbytes: int) -> str | None:
    cudart = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(address, nbytes, 0)
    return None if rc == cudart.cudaError.success else str(cudart.cudaGetErrorString(rc))


def cuda_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def _unlock_all(addresses: list[int], unregister: Unregister) -> None:
    for address in addresses:
        unregister(address)


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel * dtype.itemsize
