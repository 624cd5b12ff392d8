"""Reading torch.distributed.checkpoint (DCP) folders without running code from them.

Stock DCP unpickles ``.metadata`` with ``pickle.load`` and every non-tensor entry (LR scheduler state,
optimizer hyper-parameters) with ``torch.load(weights_only=False)``: whoever can write a checkpoint
folder can make a resume run code. Here:

- ``SafeFileSystemReader`` reads ``.metadata`` with an unpickler that resolves only the globals a
  DCP metadata file is made of (the classes of ``torch.distributed.checkpoint.metadata``, torch sizes,
  dtypes and layouts, paths); any other global is an UnpicklingError naming it;
- ``WeightsOnlyLoadPlanner`` loads the non-tensor entries with ``torch.load(weights_only=True)``
  (plain containers and numbers, which is all a scheduler or an optimizer's hyper-parameters hold).

DeepSpeed checkpoints (train.strategy=deepspeed) are still read by DeepSpeed's own ``torch.load``
calls, with ``weights_only=False``: see the Security line in the README.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

_DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to torch.strided etc.
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module in _DCP_MODULES and not name.startswith("__")):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a DCP metadata file "
                                     "never holds; refusing to load it (it could run code)")


def load_metadata(file) -> Any:
    """Unpickle a DCP ``.metadata`` stream, resolving only the globals it is made of."""
    return _MetadataUnpickler(file).load()


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose ``.metadata`` is unpickled with the allow-list above."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as file:
            metadata = load_metadata(file)
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner with ``torch.load(weights_only=True)`` for the non-tensor entries."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def safe_load_kwargs(path: str | Path) -> dict:
    """Keyword arguments for ``dcp.load`` that read ``path`` without unpickling code."""
    return {"storage_reader": SafeFileSystemReader(str(path)), "planner": WeightsOnlyLoadPlanner()}
