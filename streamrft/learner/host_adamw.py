"""AdamW whose moment estimates live in host memory (``train.optimizer_offload``): full fine-tuning of a model
whose fp32 weights, gradients and AdamW state do not fit on the device together.

Why: with fp32 master weights, full fine-tuning keeps 16 bytes per parameter on the device (weights, gradients,
exp_avg, exp_avg_sq): 113.5 GiB at 7.6B parameters, and torch's default multi-tensor AdamW allocates one more
full-size temporary (sqrt of exp_avg_sq) inside ``step``: 142 GiB, more than one 141 GB GPU. Keeping the two
moments in (pinned) host memory takes 8 bytes per parameter off the device (56.7 GiB at 7.6B); each step then
streams them through: for parameter i the moments are copied host -> device on a side stream while parameter
i-1 is updated, and copied back after the update (16 bytes per parameter over PCIe per step, overlapped with
the updates). The device holds at most two parameters' moments at a time.

The update is torch.optim.AdamW's (single-tensor form, no amsgrad): with t the step count, g the gradient,
  p <- p * (1 - lr * wd);  m <- m + (1 - b1) (g - m);  v <- b2 v + (1 - b2) g^2
  p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
computed in the same order, so a run matches torch AdamW. The state keys are AdamW's (``step``, ``exp_avg``,
``exp_avg_sq``; the moments are DTensors sharded like their parameter, with host-local shards), so checkpoints
are interchangeable with ``train.optimizer_offload=false`` and DCP saves each rank's shard.
On a CPU learner "host" and "device" are the same memory: the moments are still copied in and out per
parameter (the same code path, testable without a GPU).
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


MOMENTS = ("exp_avg", "exp_avg_sq")


def _register(buf: torch.Tensor) -> bool:
    """Page-lock ``buf`` in place (exact size) so host <-> device copies are asynchronous; False if refused."""
    from streamrft.checkpoint.pinning import cuda_register

    error = cuda_register(buf.data_ptr(), buf.numel() * buf.element_size())
    if error is not None:
        warnings.warn(f"train.optimizer_offload: cudaHostRegister of {buf.numel() * 4 / 2**30:.1f} GiB failed "
                      f"({error}); the AdamW moments stay in pageable host memory (slower copies)")
        return False
    return True


def _like(p: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """``host`` (p's local shard's shape, in host memory) as a DTensor sharded like ``p``, or itself.

    Not DTensor.from_local: it moves the local tensor to the mesh's device type (the GPU). The constructor keeps
    it where it is, as FSDP2's own CPU offload does for its sharded parameters."""
    if not isinstance(p, DTensor):
        return host
    spec = DTensorSpec(p.device_mesh, p.placements, TensorMeta(p.shape, p.stride(), torch.float32))
    return DTensor(host, spec, requires_grad=False)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's local shard; the tensor itself otherwise). In-place ops on it
    update the parameter."""
    return t.to_local() if isinstance(t, DTensor) else t


class HostAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update with exp_avg / exp_avg_sq in host memory (see the module docstring)."""

    keeps_state_on_host = True  # learner/memory.py leaves the moments where they are when it offloads/reloads

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._copy_stream = None  # CUDA: host <-> device copies run beside the updates
        self._flat: dict[str, torch.Tensor] = {}
        self._pinned: list[torch.Tensor] = []
        self._views: dict = {}  # param -> its moments (views of the flat buffers)

    # ---- state --------------------------------------------------------------------------------------------
    def _allocate(self) -> None:
        """Both moments of every parameter, zeroed, as views of one flat host buffer per moment.

        Why flat: torch's pinned-memory allocator rounds each block up to a power of two (a 271 MB MLP weight
        takes 512 MB), which at 7B would pin ~1.8x the state; one buffer of the exact size, registered with
        cudaHostRegister, pins what is used. If registration fails the buffers stay pageable (correct, slower
        copies) and a warning says so."""
        params = [p for g in self.param_groups for p in g["params"]]
        total = sum(local_shard(p).numel() for p in params)
        cuda = local_shard(params[0]).is_cuda
        self._flat = {key: torch.zeros(total, dtype=torch.float32) for key in MOMENTS}
        if cuda:
            self._pinned = [buf for buf in self._flat.values() if _register(buf)]
        offset = 0
        for p in params:
            loc = local_shard(p)
            st = self.state[p]
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in MOMENTS:
                view = self._flat[key][offset: offset + loc.numel()].view(loc.shape)
                st[key] = _like(p, view)
            self._views[p] = {key: st[key] for key in MOMENTS}  # where load_state_dict copies a checkpoint to
            offset += loc.numel()

    def load_state_dict(self, state_dict) -> None:
        """Load a checkpoint's moments into this optimizer's host buffers.

        torch's own load would first copy every moment to its parameter's device (57 GiB of GPU memory at 7B,
        the very thing this optimizer avoids), so the moments are taken out before it runs and copied into the
        buffers here; torch loads the rest (steps, param groups)."""
        if not self._flat:
            self._allocate()
        moments, rest = {}, {}
        for pid, st in state_dict["state"].items():
            moments[pid] = {k: v for k, v in st.items() if k in MOMENTS}
            rest[pid] = {k: v for k, v in st.items() if k not in MOMENTS}
        super().load_state_dict({**state_dict, "state": rest})
        by_id = {pid: p for saved, group in zip(state_dict["param_groups"], self.param_groups)
                 for pid, p in zip(saved["params"], group["params"])}
        for pid, loaded in moments.items():
            p = by_id[pid]
            st = self.state[p]
            for key in MOMENTS:
                view = self._views[p][key]
                if key in loaded and local_shard(loaded[key]).data_ptr() != local_shard(view).data_ptr():
                    local_shard(view).copy_(local_shard(loaded[key]).to(torch.float32))
                st[key] = view
            if "step" in st:  # a CPU scalar of our own (torch keeps the caller's tensor)
                st["step"] = torch.as_tensor(st["step"]).detach().to("cpu", torch.float32).clone()

    def __del__(self):
        for buf in getattr(self, "_pinned", []):
            try:
                torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
            except Exception:  # noqa: BLE001 - interpreter shutdown: the process's memory goes anyway
                pass

    # ---- step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state.get(p):
                    self._allocate()
                work.append((group, p, self.state[p]))
        if not work:
            return loss
        cuda = local_shard(work[0][1]).is_cuda
        if cuda and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=local_shard(work[0][1]).device)
        nxt = self._fetch(work[0][1], work[0][2], cuda)
        for i, (group, p, st) in enumerate(work):
            m, v, ready = nxt
            if i + 1 < len(work):  # the next parameter's moments travel while this one updates
                nxt = self._fetch(work[i + 1][1], work[i + 1][2], cuda)
            if cuda:
                torch.cuda.current_stream().wait_event(ready)
            self._update(group, p, st, m, v)
            self._write_back(st, m, v, cuda)
        if cuda:  # the last write-backs are complete before anyone reads the host moments
            self._copy_stream.synchronize()
        return loss

    def _fetch(self, p: torch.Tensor, st: dict, cuda: bool):
        """Device copies of ``p``'s moments (issued on the copy stream on CUDA) and the event marking them ready."""
        dev = local_shard(p).device
        if not cuda:
            return local_shard(st["exp_avg"]).clone(), local_shard(st["exp_avg_sq"]).clone(), None
        with torch.cuda.stream(self._copy_stream):
            m = local_shard(st["exp_avg"]).to(dev, non_blocking=True)
            v = local_shard(st["exp_avg_sq"]).to(dev, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        # allocated on the copy stream, used on the compute stream: not reused before the update is done
        m.record_stream(torch.cuda.current_stream(dev))
        v.record_stream(torch.cuda.current_stream(dev))
        return m, v, ready

    def _write_back(self, st: dict, m: torch.Tensor, v: torch.Tensor, cuda: bool) -> None:
        if not cuda:
            local_shard(st["exp_avg"]).copy_(m)
            local_shard(st["exp_avg_sq"]).copy_(v)
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(m.device))
        self._copy_stream.wait_event(done)
        with torch.cuda.stream(self._copy_stream):
            local_shard(st["exp_avg"]).copy_(m, non_blocking=True)
            local_shard(st["exp_avg_sq"]).copy_(v, non_blocking=True)

    @staticmethod
    def _update(group: dict, p: torch.Tensor, st: dict, m: torch.Tensor, v: torch.Tensor) -> None:
        """torch.optim.AdamW's single-tensor update (amsgrad off, maximize off) on the local shard."""
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        param, grad = local_shard(p), local_shard(p.grad)
        st["step"] += 1
        t = float(st["step"])
        if wd != 0:
            param.mul_(1 - lr * wd)
        m.lerp_(grad, 1 - b1)
        v.mul_(b2).addcmul_(grad, grad.conj(), value=1 - b2)
        step_size = lr / (1 - b1 ** t)
        denom = (v.sqrt() / (1 - b2 ** t) ** 0.5).add_(eps)
        param.addcdiv_(m, denom, value=-step_size)
