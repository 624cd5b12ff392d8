"""Where checkpoints live on disk, which one is the latest, and which ones rotation removes.

Layout (one folder per saved step, ``k`` = train steps completed)::

    {output_dir}/checkpoints/step_{k:08d}/
        .metadata, __*_*.distcp    torch.distributed.checkpoint shards: model, optimizer, LR scheduler
        rank_{r:05d}.json          per-rank state: RNG (torch, python, numpy), accounting, counters
        hf/                        Hugging Face config and tokenizer (what export needs besides weights)
        config.json                the resolved config of the run (checkpoint/guard.py: the resume guard)
        meta.json                  written last, atomically: its presence marks the checkpoint complete

A folder without ``meta.json`` is an interrupted save: it is never resumed from, and rotation removes
it once a newer complete checkpoint exists. A complete checkpoint that does not load is renamed
``unloadable_step_*`` (``set_aside``) and the resume falls back to the next newest. "Latest" is found by scanning, not by a pointer file, so a
crash between writing a checkpoint and updating a pointer cannot leave them disagreeing.

No torch here: this module is plain file-system bookkeeping.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

META = "meta.json"
FORMAT = 1  # meta.json "format": bump when the layout changes incompatibly
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir(output_dir: str | Path, step: int) -> Path:
    """The folder of the checkpoint taken after ``step`` completed train steps."""
    if step < 0:
        raise ValueError(f"checkpoint step={step} must be >= 0")
    return checkpoints_root(output_dir) / f"step_{step:08d}"


def rank_file(path: Path, rank: int) -> Path:
    return Path(path) / f"rank_{rank:05d}.json"


def _scan(output_dir: str | Path) -> list[tuple[int, Path, bool]]:
    """(step, folder, complete) for every step_* folder, oldest first."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry, (entry / META).is_file()))
    return sorted(found)


def complete_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint (with meta.json), oldest first."""
    return [(step, path) for step, path, complete in _scan(output_dir) if complete]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    done = complete_checkpoints(output_dir)
    return done[-1][1] if done else None


def loadable_checkpoints(output_dir: str | Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """Complete checkpoints, newest first, whose small files read back (meta.json, every rank's
    ``rank_*.json``, ``config.json``), and the ones that do not, with the reason. The shards are not
    read here (that is the strategy's load, which may still fail: see Checkpointer.resume)."""
    good, bad = [], []
    for _, path in reversed(complete_checkpoints(output_dir)):
        try:
            meta = read_meta(path)
            for rank in range(int(meta["world_size"])):
                _read_json(rank_file(path, rank))
            if (path / "config.json").exists():
                _read_json(path / "config.json")
        except (ValueError, KeyError, TypeError) as exc:
            bad.append((path, str(exc)))
            continue
        good.append(path)
    return good, bad


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def set_aside(path: str | Path, reason: str) -> Path:
    """Rename a checkpoint that does not load to ``unloadable_step_*`` (kept for inspection, with the
    reason in ``UNLOADABLE.txt``): scans and rotation ignore it, and a later save of the same step
    cannot mix its files with the old ones."""
    path = Path(path)
    target = path.with_name("unloadable_" + path.name)
    n = 1
    while target.exists():
        target, n = path.with_name(f"unloadable{n}_" + path.name), n + 1
    os.replace(path, target)
    (target / "UNLOADABLE.txt").write_text(reason + "\n")
    return target


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a user path: a step_* folder itself, or an output_dir / its checkpoints
    folder (then the latest complete checkpoint in it). ValueError says what was found instead."""
    p = Path(path)
    if (p / META).is_file():
        return p
    if _STEP_DIR.match(p.name) and p.is_dir():
        raise ValueError(f"checkpoint {p} is incomplete (no {META}): its save was interrupted; use an earlier step")
    for output_dir in (p, p.parent if p.name == "checkpoints" else None):
        if output_dir is not None:
            latest = latest_checkpoint(output_dir)
            if latest is not None:
                return latest
    raise ValueError(f"{p} is neither a checkpoint folder (step_XXXXXXXX with {META}) nor an output_dir "
                     "holding one under checkpoints/")


def read_meta(path: str | Path) -> dict:
    meta_path = Path(path) / META
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{meta_path}: cannot read checkpoint metadata: {exc}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: cannot read checkpoint metadata: not a JSON object")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: format={meta.get('format')!r}, this version reads format {FORMAT}")
    return meta


def write_json_atomic(path: str | Path, data: dict) -> None:
    """Write JSON to ``path`` through a temporary file and a rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_meta(path: str | Path, meta: dict) -> None:
    """Mark the checkpoint in ``path`` complete (call after every shard and rank file is written)."""
    write_json_atomic(Path(path) / META, {"format": FORMAT, **meta})


def rotate(output_dir: str | Path, keep: int) -> list[Path]:
    """Remove all but the ``keep`` newest complete checkpoints, and interrupted saves older than the
    newest complete one. Returns the removed folders (oldest first)."""
    if keep < 1:
        raise ValueError(f"checkpoint.keep={keep} must be >= 1")
    entries = _scan(output_dir)
    complete = [step for step, _, done in entries if done]
    if not complete:
        return []
    kept = set(complete[-keep:])
    newest = complete[-1]
    removed = []
    for step, path, done in entries:
        if (done and step not in kept) or (not done and step < newest):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def remove_incomplete(output_dir: str | Path) -> list[Path]:
    """Remove every interrupted save (at start-up, before anything writes a new checkpoint)."""
    removed = []
    for _, path, done in _scan(output_dir):
        if not done:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
