"""JSON Lines trajectory sink: one file per rank, one TrajectoryRecord JSON object per line."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from protocols import TrajectoryRecord

_encoder = msgspec.json.Encoder()
_FLUSH_BYTES = 1 << 20  # a step's records usually fit; more is written early, whole lines only


class JsonlSink:
    """Appends to ``<dir>/<run_id>-rank<rank>.jsonl``. A training process draws a fresh ``run_id``, so a resumed
    run writes a file beside the killed one's; readers take the directory (``sinks.reader``).

    Lines are the msgspec JSON of the record (``kind`` and ``protocol_version`` included), so
    ``msgspec.json.decode(line, type=TrajectoryRecord)`` reads one back.

    The file only ever receives whole lines (records are buffered here, not in a file object that
    flushes wherever its buffer fills), so a killed process leaves at most one torn last line: the
    one ``write(2)`` the kill interrupted, which the reader skips. Opening an existing file again (a
    caller that reuses a run id) cuts such a line off with a message, so later lines are not glued onto it.
    """

    def __init__(self, directory: str | os.PathLike, run_id: str, rank: int):
        self.path = Path(directory) / f"{run_id}-rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cut_torn_tail(self.path)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._pending = bytearray()

    def write(self, record: TrajectoryRecord) -> None:
        self._pending += _encoder.encode(record)
        self._pending += b"\n"
        if len(self._pending) >= _FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        view = memoryview(self._pending)
        while view:  # write(2) may take part of a large buffer; the rest follows at once
            view = view[os.write(self._fd, view):]
        view.release()
        self._pending.clear()

    def close(self) -> None:
        if self._fd is not None:
            self.flush()
            os.close(self._fd)
            self._fd = None


def cut_torn_tail(path: Path) -> int:
    """Truncate ``path`` after its last newline if it does not end with one; the bytes cut (0 if none).

    Only a writer killed inside ``write(2)`` leaves such a tail; the record it held is lost either way,
    and keeping it would corrupt the next line appended."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    if size == 0:
        return 0
    with open(path, "r+b") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        keep = _end_of_last_line(f, size)
        f.truncate(keep)
    print(f"streamrft: {path}: cut off a torn last line ({size - keep} bytes, its writer was killed)", flush=True)
    return size - keep


def _end_of_last_line(f, size: int) -> int:
    """The offset just after the last newline of the open file ``f`` (0 if it has none)."""
    position = size
    while position > 0:
        start = max(0, position - (1 << 16))
        f.seek(start)
        chunk = f.read(position - start)
        newline = chunk.rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        position = start
    return 0
