"""JSON Lines trajectory sink: one file per rank, one TrajectoryRecord JSON object per line."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from protocols import TrajectoryRecord

_encoder = msgspec.json.Encoder()


class JsonlSink:
    """Appends to ``<dir>/<run_id>-rank<rank>.jsonl`` (appending keeps a resumed run in one file).

    Lines are the msgspec JSON of the record (``kind`` and ``protocol_version`` included), so
    ``msgspec.json.decode(line, type=TrajectoryRecord)`` reads one back.
    """

    def __init__(self, directory: str | os.PathLike, run_id: str, rank: int):
        self.path = Path(directory) / f"{run_id}-rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab", buffering=1 << 20)

    def write(self, record: TrajectoryRecord) -> None:
        self._file.write(_encoder.encode(record) + b"\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()
