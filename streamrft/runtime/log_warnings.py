"""Warnings that a child process writes to its log file, echoed once each on the parent's console.

The async placement's engine processes write to ``output_dir/engines/engine<e>.log``. A warning there (a
static chunk capped to the free memory, a Triton kernel falling back to the torch ops, a compaction that
failed) says the run is slower or rounds differently than configured, and nobody would see it without
opening that file. Learner rank 0 reads what each log gained since its last look (every half second
while it waits for samples, and once more when the engines stop) and prints each Python warning line,
naming the engine rank. Only complete lines are read: a line still being written waits for its end.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TextIO

# what warnings.showwarning writes: "<file>:<line>: <Category>Warning: <message>"
WARNING_LINE = re.compile(r"\b[A-Z]\w*Warning: .+$")


class LogWarnings:
    """The warnings appended to one log file since the last ``echo_new``."""

    def __init__(self, path: Path, label: str, out: TextIO | None = None):
        self.path, self.label, self.out = path, label, out
        self._offset = 0
        self._partial = b""  # the end of the last read, after its last newline

    def echo_new(self) -> list[str]:
        """Print (``streamrft: <label>: <warning>``) and return the warning lines completed since the last call."""
        try:
            size = self.path.stat().st_size
        except OSError:  # not created yet, or removed
            return []
        if size < self._offset:  # truncated or replaced: read it again from its start
            self._offset, self._partial = 0, b""
        if size == self._offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        found = [m.group(0) for line in lines if (m := WARNING_LINE.search(line.decode(errors="replace")))]
        out = self.out or sys.stderr
        for warning in found:
            print(f"streamrft: {self.label}: {warning}", file=out, flush=True)
        return found
