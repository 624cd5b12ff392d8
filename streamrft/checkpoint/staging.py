"""Host-memory staging of a state dict, so an asynchronous save can write while training goes on.

``HostStager.stage(state)`` returns a copy of ``state`` whose tensors live in host memory: the train step
may change the originals right after it returns, the background writer reads only the copy.

- DTensors keep their sharding spec (the DCP planner needs it to lay out the global checkpoint); only the
  local shard is copied.
- The host buffers are kept between saves and reused when the shapes match: allocating and first-touching
  gigabytes of host memory costs seconds per save on a VM (see benchmarks/NOTES.md), a copy into touched
  memory does not. They are carved from one ``HostSlab`` (checkpoint/pinning.py), page-locked in place when
  the state is on a GPU (device-to-host copies at full speed, issued non-blocking and synchronised once at
  the end) without holding the CUDA driver's lock for the whole allocation.
- Everything that is not a tensor (LR scheduler fields, Python scalars) is deep-copied.
- ``prewarm(state, window)`` allocates (and touches) the buffers in a background thread ahead of the first
  save, so even the first save only copies (the Checkpointer calls it after the first train step, once the
  optimizer state exists). Given a ``HostIdleWindow`` (runtime/host_idle.py: the colocated static-cache
  engine's decode), the page-locking runs only while it is open, one chunk at a time with a pause as long
  as the chunk between them; beside the second rollout's prefill and the second train step it stalled
  their launches. A save that comes first does not wait for the window: ``stage`` finishes the prewarm at
  once. Nor does a prewarm whose window stays shut for ``WINDOW_PATIENCE_S``.

The caller must not stage again while a write from the previous staging is still reading the buffers
(the Checkpointer keeps at most one save in flight, waiting for the previous one first).
"""

from __future__ import annotations

import copy
import threading
import time

import torch

WINDOW_PATIENCE_S = 300.0  # a prewarm waits this long at most for the window between two chunks, then locks anyway


class HostStager:
    def __init__(self, rank: int = 0):
        self.rank = rank  # named in a warning
        self._buffers: dict[tuple, torch.Tensor] = {}  # state-dict path -> reused host buffer
        self._slabs: list = []  # the HostSlabs the buffers are views of (their pages stay locked while kept)
        self.bytes_staged = 0  # of the last stage() call
        self.bytes_allocated = 0  # of the last stage() call (0 once the buffers are warm)
        self._prewarm: threading.Thread | None = None
        self._lock_now = threading.Event()  # the prewarm locks the rest without waiting: stage() needs the buffers

    def prewarm(self, state, window=None) -> None:
        """Allocate host buffers for ``state``'s tensors in a background thread (shapes are read here,
        nothing is copied), page-locking them while ``window`` (a HostIdleWindow, or None: at once) is open.
        A failure there only means stage() allocates them itself (and raises then)."""
        specs = self._specs(state)
        pace = None if window is None else self._pacer(window)
        self._prewarm = threading.Thread(target=self._allocate, args=(specs, pace),
                                         name="streamrft-checkpoint-prewarm", daemon=True)
        self._prewarm.start()

    def _pacer(self, window):
        """Before each chunk: pause as long as the last one held the driver (the decode loop's launches go
        through), then wait for the window, unless stage() is waiting for the buffers."""
        def pace(held_s: float) -> None:
            if self._lock_now.wait(held_s):
                return
            deadline = time.monotonic() + WINDOW_PATIENCE_S
            while not self._lock_now.is_set() and not window.wait(0.05):
                if time.monotonic() > deadline:  # no rollout decodes here (or not any more): lock the rest now
                    self._lock_now.set()
        return pace

    def _specs(self, state) -> list[tuple[tuple, torch.Size, torch.dtype, bool]]:
        specs: list[tuple[tuple, torch.Size, torch.dtype, bool]] = []
        self._shapes(state, (), specs)
        return specs

    def _allocate(self, specs: list[tuple[tuple, torch.Size, torch.dtype, bool]], pace=None) -> int:
        """One slab for every spec's buffer, page-locked when any source is on a GPU; returns its bytes."""
        from streamrft.checkpoint.pinning import HostSlab

        slab = HostSlab([(shape, dtype) for _, shape, dtype, _ in specs], pin=any(cuda for *_, cuda in specs),
                        rank=self.rank, pace=pace)
        self._slabs.append(slab)
        for (path, *_), view in zip(specs, slab.views):
            self._buffers.setdefault(path, view)
        return sum(v.numel() * v.element_size() for v in slab.views)

    def _shapes(self, obj, path: tuple, out: list) -> None:
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            obj = obj._local_tensor
        if isinstance(obj, torch.Tensor):
            out.append((path, obj.shape, obj.dtype, obj.is_cuda))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                self._shapes(v, (*path, k), out)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                self._shapes(v, (*path, i), out)

    def stage(self, state):
        """A host-memory copy of ``state`` (nested dicts / lists / tuples of tensors and plain values)."""
        if self._prewarm is not None:  # the buffers it is allocating are the ones about to be used
            self._lock_now.set()
            self._prewarm.join()
            self._prewarm = None
        self.bytes_staged = self.bytes_allocated = 0
        if not self._buffers:  # not prewarmed (a save at the first step): one slab now
            self.bytes_allocated = self._allocate(self._specs(state))
        self._cuda = False
        out = self._copy(state, ())
        if self._cuda:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        return out

    def _copy(self, obj, path: tuple):
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            local = self._tensor(obj._local_tensor, path)
            return DTensor(local, obj._spec, requires_grad=False)  # same placement and global shape, host shard
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path)
        if isinstance(obj, dict):
            return {k: self._copy(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, (*path, i)) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return copy.deepcopy(obj)

    def _tensor(self, t: torch.Tensor, path: tuple) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:  # the state changed shape: its own buffer
            pin = t.is_cuda
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
            self.bytes_allocated += buf.numel() * buf.element_size()
        self._cuda |= t.is_cuda
        buf.copy_(t, non_blocking=t.is_cuda)
        self.bytes_staged += buf.numel() * buf.element_size()
        return buf
