"""One checkpoint write at a time in a background thread, whose failure is never lost.

The Checkpointer hands a staged (host-memory) checkpoint to ``submit`` and returns to training. The
rules that keep this as safe as a synchronous save:
- at most one write in flight: ``submit`` first waits for the previous write (the staging buffers are
  reused, and meta.json of step k must not race the shards of step k+1);
- every wait has a timeout (checkpoint.save_timeout_s) ending in an error naming the checkpoint and rank;
- a failed write is kept and raised in the training thread at the next ``wait``/``submit``/``check``,
  so the run fails with the write's error (never exit 0 with a checkpoint missing).

The thread is a daemon: a process that dies for another reason does not hang on a write; the folder
it leaves has no meta.json and is ignored (and later removed) at resume.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable


class CheckpointSaveError(RuntimeError):
    """An asynchronous checkpoint write failed or did not finish in time."""


class BackgroundWriter:
    def __init__(self, rank: int, timeout_s: float):
        self.rank, self.timeout_s = rank, timeout_s
        self._thread: threading.Thread | None = None
        self._path: Path | None = None
        self._error: BaseException | None = None
        self.last_write_seconds: float | None = None  # of the newest write that finished

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def submit(self, path: Path, job: Callable[[], None]) -> None:
        """Run ``job`` (the write of checkpoint ``path``) in the background, after the previous one."""
        self.wait()
        self._path, self._error = path, None

        def run() -> None:
            started = time.perf_counter()
            try:
                job()
            except BaseException as exc:  # kept for the training thread: see check()
                self._error = exc
            self.last_write_seconds = time.perf_counter() - started

        self._thread = threading.Thread(target=run, name=f"streamrft-checkpoint-rank{self.rank}", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise the error of a write that already failed (no waiting)."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Block until the write in flight is on disk; raise its error, or CheckpointSaveError on timeout."""
        thread = self._thread
        if thread is None:
            return
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise CheckpointSaveError(
                f"checkpoint {self._path}: the background write on rank {self.rank} did not finish within "
                f"checkpoint.save_timeout_s={self.timeout_s:g} s (a slow disk, or another rank stopped writing); "
                "the previous complete checkpoint stays the latest")
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
