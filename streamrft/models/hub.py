"""Model paths: a local directory, or a Hugging Face hub id that is already in the local cache.

``resolve_model_dir("Qwen/Qwen2.5-0.5B-Instruct", "model.path")`` returns the cached snapshot directory
(``$HF_HOME/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/<rev>``, the revision ``refs/main`` names),
found with ``huggingface_hub.snapshot_download(local_files_only=True)``: the lookup transformers does
with ``HF_HUB_OFFLINE=1``. Nothing is downloaded here: the config check runs before any process starts,
and a run that would fetch gigabytes from inside a training rank is a run that stalls without a word.

The cache directory is read from the environment at call time (``HF_HUB_CACHE``, else ``HF_HOME/hub``,
else ``XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``), not from
``huggingface_hub.constants``, which freezes it at import.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# org/name or name, as the hub spells repository ids (letters, digits, - _ .)
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as the environment sets it now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def looks_like_hub_id(value: str) -> bool:
    return bool(_HUB_ID.match(value)) and not value.startswith(".") and ".." not in value


def resolve_model_dir(value: str, key: str) -> str:
    """A local model directory holding config.json, for a directory or a cached hub id; ValueError naming
    ``key`` (e.g. ``model.path``) otherwise."""
    if not value:
        raise ValueError(f"{key} is empty; set it to a Hugging Face model directory or a hub id in the local cache")
    local = Path(value).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ValueError(f"{key}={value}: no config.json there (a directory that has no config.json is not a "
                             f"Hugging Face model); point {key} at a directory written by save_pretrained or a hub id "
                             "in the local Hugging Face cache")
        return str(local)
    if not looks_like_hub_id(value):  # a path (absolute, ./, ../, two or more slashes) that is not there
        raise ValueError(f"{key}={value}: no config.json there (the directory does not exist, so it has no "
                         f"config.json, and it is not a hub id org/name); point {key} at a Hugging Face model "
                         "directory or a hub id in the local Hugging Face cache")
    cache = hub_cache_dir()
    snapshot = _cached_snapshot(value, cache)
    if snapshot is None:
        raise ValueError(
            f"{key}={value} is not a directory and not in the Hugging Face cache at {cache}; download it with "
            f"`hf download {value}` (huggingface-cli download {value} before huggingface_hub 1.0) on a machine "
            "with network, or set HF_HOME to the cache that has it")
    if not (Path(snapshot) / "config.json").is_file():
        raise ValueError(f"{key}={value}: the cached snapshot {snapshot} has no config.json; download the whole "
                         f"repository with `hf download {value}`")
    return snapshot


def _cached_snapshot(repo_id: str, cache: Path) -> str | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return str(snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        return None
