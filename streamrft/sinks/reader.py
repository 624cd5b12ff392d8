"""Read trajectory records back from what the JSONL and Parquet sinks wrote."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import msgspec

from protocols import TrajectoryRecord

_json_decoder = msgspec.json.Decoder(TrajectoryRecord)
# Arrow map columns come back as lists of (key, value) pairs; these fields need them as dicts.
_DICT_FIELDS = [f.name for f in msgspec.structs.fields(TrajectoryRecord) if getattr(f.type, "__origin__", None) is dict]


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        # Finished files only: "*.parquet.inprogress" is still being written (see sinks/parquet.py).
        found = sorted(path.glob("*.jsonl")) + sorted(path.glob("*.parquet"))
        if found:
            return found
        raise FileNotFoundError(f"{path} holds no *.jsonl or *.parquet trajectory files")
    raise FileNotFoundError(f"trajectory path {path} does not exist")


def _read_jsonl(path: Path) -> Iterator[TrajectoryRecord]:
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield _json_decoder.decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                if not line.endswith(b"\n"):
                    return  # the last line, still being written (or its writer was killed inside write(2))
                raise ValueError(f"{path}:{line_number}: not a TrajectoryRecord: {exc}") from None


def _read_parquet(path: Path) -> Iterator[TrajectoryRecord]:
    import pyarrow.parquet as pq

    for row in pq.read_table(path).to_pylist():
        for key in _DICT_FIELDS:
            if row.get(key) is not None:
                row[key] = dict(row[key])
        try:
            yield msgspec.convert(row, TrajectoryRecord)
        except msgspec.ValidationError as exc:
            raise ValueError(f"{path}: row is not a TrajectoryRecord: {exc}") from None


def read_trajectories(path: str | os.PathLike) -> Iterator[TrajectoryRecord]:
    """Records from a ``.jsonl`` or ``.parquet`` file, or from every such file in a directory."""
    for file in _files(Path(path)):
        yield from (_read_parquet(file) if file.suffix == ".parquet" else _read_jsonl(file))
