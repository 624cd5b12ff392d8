"""CompletionGate: whether a saved checkpoint may be marked complete (meta.json), decided once.

A checkpoint of step ``s`` may only become complete after the training loop has written step ``s``'s
records (its steps.jsonl line and trajectories): otherwise a process killed in between resumes after a
step that was never logged. So each save gets a gate, settled exactly once:
- ``commit()``: the records are written; the checkpoint may be completed;
- ``abandon()``: the step ended without its records (the run stops or the next save begins); the
  checkpoint stays incomplete and resume removes it.
The first of the two wins; later calls change nothing (the loop commits every step, saved or not).

A synchronous save completes in the thread that commits (``on_commit``); an asynchronous one completes
in its background writer, which ``wait``s for the gate after the shards are on disk. That wait is bounded
by checkpoint.save_timeout_s and ends in an error naming the stage and the rank, never a hang.
"""

from __future__ import annotations

import threading
from typing import Callable

from streamrft.checkpoint.background import CheckpointSaveError

STAGE = "checkpoint_commit"


class CompletionGate:
    def __init__(self, what: str, rank: int, timeout_s: float, on_commit: Callable[[], None] | None = None):
        """``what``: the checkpoint, for messages; ``timeout_s``: checkpoint.save_timeout_s, the bound of
        every ``wait``; ``on_commit``: run once by ``commit()``, in its thread (the sync save's meta.json)."""
        self.what, self.rank, self.timeout_s = what, rank, timeout_s
        self._on_commit = on_commit
        self._lock = threading.Lock()  # commit and abandon come from the training thread, wait from the writer
        self._settled = threading.Event()
        self._committed = False

    @property
    def settled(self) -> bool:
        return self._settled.is_set()

    def commit(self) -> None:
        """The step's records are written. Runs ``on_commit`` unless the gate was settled before."""
        if self._settle(committed=True) and self._on_commit is not None:
            self._on_commit()

    def abandon(self) -> None:
        """The step's records will not be written: the checkpoint stays incomplete (no-op once committed)."""
        self._settle(committed=False)

    def wait(self) -> bool:
        """Block until settled; True when committed, False when abandoned. Raises CheckpointSaveError naming
        the stage and rank when neither happens within ``timeout_s``."""
        if not self._settled.wait(self.timeout_s):
            raise CheckpointSaveError(
                f"stage {STAGE} on rank {self.rank}: checkpoint {self.what} was neither committed nor abandoned "
                f"within checkpoint.save_timeout_s={self.timeout_s:g} s (its step's records were not written); "
                "it has no meta.json, so the previous complete checkpoint stays the latest")
        return self._committed

    def _settle(self, committed: bool) -> bool:
        with self._lock:
            if self._settled.is_set():
                return False
            self._committed = committed
            self._settled.set()  # after _committed: a waiter woken by it reads the final decision
            return True
