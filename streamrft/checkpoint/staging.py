"""Host-memory staging of a state dict, so an asynchronous save can write while training goes on.

``HostStager.stage(state)`` returns a copy of ``state`` whose tensors live in host memory: the train step
may change the originals right after it returns, the background writer reads only the copy.

- DTensors keep their sharding spec (the DCP planner needs it to lay out the global checkpoint); only the
  local shard is copied.
- The host buffers are kept between saves and reused when the shapes match: allocating and first-touching
  gigabytes of host memory costs seconds per save on a VM (see benchmarks/NOTES.md), a copy into touched
  memory does not. Buffers are pinned when the source is on a GPU (device-to-host copies at full speed,
  issued non-blocking and synchronised once at the end).
- Everything that is not a tensor (LR scheduler fields, Python scalars) is deep-copied.
- ``prewarm(state)`` allocates (and touches) the buffers in a background thread ahead of the first save,
  so even the first save only copies (the Checkpointer calls it after the first train step, once the
  optimizer state exists).

The caller must not stage again while a write from the previous staging is still reading the buffers
(the Checkpointer keeps at most one save in flight, waiting for the previous one first).
"""

from __future__ import annotations

import copy
import threading

import torch


class HostStager:
    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}  # state-dict path -> reused host buffer
        self.bytes_staged = 0  # of the last stage() call
        self.bytes_allocated = 0  # of the last stage() call (0 once the buffers are warm)
        self._prewarm: threading.Thread | None = None

    def prewarm(self, state) -> None:
        """Allocate host buffers for ``state``'s tensors in a background thread (shapes are read here,
        nothing is copied). A failure there only means stage() allocates them itself (and raises then)."""
        specs: list[tuple[tuple, torch.Size, torch.dtype, bool]] = []
        self._shapes(state, (), specs)

        def allocate() -> None:
            for path, shape, dtype, pin in specs:
                buf = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
                if not pin:
                    buf.zero_()  # first touch of the pages now, not inside the train step's save
                self._buffers.setdefault(path, buf)

        self._prewarm = threading.Thread(target=allocate, name="streamrft-checkpoint-prewarm", daemon=True)
        self._prewarm.start()

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
            self._prewarm.join()
            self._prewarm = None
        self.bytes_staged = self.bytes_allocated = 0
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
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = t.is_cuda
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
            self.bytes_allocated += buf.numel() * buf.element_size()
        self._cuda |= t.is_cuda
        buf.copy_(t, non_blocking=t.is_cuda)
        self.bytes_staged += buf.numel() * buf.element_size()
        return buf
