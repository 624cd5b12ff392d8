"""Tensors <-> raw frames: the bytes that travel beside a channel header, described by TensorSpec.

One tensor is one frame holding its contiguous CPU bytes, in the order of the header's ``tensors``
list. Nothing is pickled: a peer in another language reads a frame with the dtype name and shape from
its TensorSpec alone.

Zero-copy both ways:
- sending, the frame is a numpy view of the tensor's own storage (pyzmq keeps a reference to it until
  libzmq has sent it), so the caller must not modify a tensor in place after handing it to ``send``;
- receiving, the tensor is a view of the ZeroMQ frame's memory (``torch.frombuffer`` keeps the frame
  alive). Over ``inproc://`` that memory may be the sender's own tensor storage, so a consumer that
  wants to write into a received tensor should ``clone()`` it first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from protocols import ProtocolError, TensorSpec


def _supported_dtypes() -> dict[str, torch.dtype]:
    names = [
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2",
    ]  # fmt: skip
    # uint16/32/64 and float8 exist only in newer torch builds; keep what this one has.
    return {name: getattr(torch, name) for name in names if isinstance(getattr(torch, name, None), torch.dtype)}


DTYPES_BY_NAME: dict[str, torch.dtype] = _supported_dtypes()
_NAME_BY_DTYPE = {dtype: name for name, dtype in DTYPES_BY_NAME.items()}


class TensorFrameError(ValueError):
    """A tensor handed to ``send`` that cannot travel as a raw frame (device, dtype, name)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype ("int64", "bfloat16"); raises TensorFrameError if unsupported."""
    name = _NAME_BY_DTYPE.get(dtype)
    if name is None:
        raise TensorFrameError(
            f"dtype {dtype} cannot travel on a channel; use one of {sorted(DTYPES_BY_NAME)}"
        )
    return name


def tensors_to_frames(tensors: Mapping[str, torch.Tensor] | None) -> tuple[list[TensorSpec], list[np.ndarray]]:
    """Specs for the header and one buffer per tensor, in the same order; no copy for contiguous input.

    A non-contiguous tensor is made contiguous (one copy). A tensor not on the CPU is a user error:
    moving it is the caller's decision (it may be a deliberate GPU-resident buffer).
    """
    specs: list[TensorSpec] = []
    buffers: list[np.ndarray] = []
    for name, tensor in (tensors or {}).items():
        if not isinstance(name, str) or not name:
            raise TensorFrameError(f"tensor name {name!r} must be a non-empty string")
        if not isinstance(tensor, torch.Tensor):
            raise TensorFrameError(f"tensors[{name!r}] is a {type(tensor).__name__}, expected a torch.Tensor")
        if not tensor.is_cpu:  # (is_cpu: no torch.device object built per tensor)
            raise TensorFrameError(
                f"tensors[{name!r}] is on device {tensor.device}; channels carry CPU bytes, "
                f"send tensors[{name!r}].cpu() (or keep it on the device and send a handle)"
            )
        specs.append(TensorSpec(name=name, dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape)))
        flat = tensor if tensor.dim() == 1 and not tensor.requires_grad else tensor.detach().reshape(-1)
        flat = flat.contiguous()  # a no-op for the usual contiguous tensor
        # Viewing as bytes works for every dtype, including bfloat16 which numpy does not know.
        buffers.append(flat.view(torch.uint8).numpy())
    return specs, buffers


# Past this a dimension cannot describe real memory (torch sizes are int64; 2**62 leaves room for numel).
MAX_DIM = 2**62


def frames_to_tensors(specs: Sequence[TensorSpec], buffers: Sequence[memoryview]) -> dict[str, torch.Tensor]:
    """Tensors viewing ``buffers`` as described by ``specs``; ProtocolError on any disagreement.

    Whatever the header and frames hold (zero or huge dimensions, a size that disagrees, a shape
    that overflows), the result is valid tensors or ProtocolError, never another exception.
    """
    if len(specs) != len(buffers):
        raise ProtocolError(
            f"header lists {len(specs)} tensor(s) {[getattr(s, 'name', s) for s in specs]} but {len(buffers)} "
            "tensor frame(s) arrived; the sender must send one frame per TensorSpec"
        )
    tensors: dict[str, torch.Tensor] = {}
    for spec, buffer in zip(specs, buffers):
        if not isinstance(spec, TensorSpec):
            raise ProtocolError(f"tensor spec {spec!r} is a {type(spec).__name__}, expected a TensorSpec")
        dtype = DTYPES_BY_NAME.get(spec.dtype)
        if dtype is None:
            raise ProtocolError(
                f"tensor {spec.name!r} has unknown dtype {spec.dtype!r}; expected one of {sorted(DTYPES_BY_NAME)}"
            )
        if spec.name in tensors:
            raise ProtocolError(f"tensor name {spec.name!r} appears twice in the header")
        _check_shape(spec)
        numel = math.prod(spec.shape)
        expected = numel * dtype.itemsize
        nbytes = memoryview(buffer).nbytes
        if nbytes != expected:
            raise ProtocolError(
                f"tensor {spec.name!r} ({spec.dtype}, shape {list(spec.shape)}) needs {expected} bytes, "
                f"its frame has {nbytes}"
            )
        try:
            tensors[spec.name] = _view(buffer, dtype, spec.shape, numel)
        except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
            # e.g. a zero-size shape whose other dimensions torch cannot represent
            raise ProtocolError(
                f"tensor {spec.name!r} ({spec.dtype}, shape {list(spec.shape)}) cannot be built: {exc}"
            ) from None
    return tensors


def _check_shape(spec: TensorSpec) -> None:
    """ProtocolError unless every dimension is an int in [0, 2**62] (one pass: it runs for every tensor of
    every pipeline message)."""
    for dim in spec.shape:
        if type(dim) is not int:
            raise ProtocolError(f"tensor {spec.name!r} has a non-integer dimension in shape {list(spec.shape)}")
        if dim < 0:
            raise ProtocolError(f"tensor {spec.name!r} has a negative dimension in shape {list(spec.shape)}")
        if dim > MAX_DIM:
            raise ProtocolError(f"tensor {spec.name!r} has a dimension above 2**62 in shape {list(spec.shape)}")


def _view(buffer: memoryview, dtype: torch.dtype, shape: tuple[int, ...], numel: int) -> torch.Tensor:
    if numel == 0:
        # torch.frombuffer refuses an empty buffer; an empty tensor owns no bytes anyway.
        return torch.empty(shape, dtype=dtype)
    # Viewed in its dtype at once (the caller checked the byte count), not as uint8 and then as dtype:
    # one tensor op less per tensor of every message.
    tensor = torch.frombuffer(buffer, dtype=dtype)
    if tensor.data_ptr() % dtype.itemsize:
        # libzmq may hand over a frame that starts at any offset of its receive buffer;
        # kernels assume dtype-aligned memory, so copy the (rare) misaligned frame.
        tensor = torch.frombuffer(buffer, dtype=torch.uint8).clone().view(dtype)
    return tensor if len(shape) == 1 else tensor.reshape(shape)
