"""HostIdleWindow: open while the host only waits on the GPU, for background work that stalls CUDA calls.

Some host work holds the CUDA driver's lock for tens of milliseconds per call: page-locking memory with
cudaHostRegister (the checkpoint stager's prewarm, checkpoint/staging.py) is the one that matters. Done
beside a train step it stalls every kernel launch of the training thread (the first train step after it
ran ~0.65 s slower at 0.5B on the H200, benchmarks/NOTES.md v14); done beside the first part of a
rollout (prefill, graph capture) it stalls those. The static-cache engine's decode loop is the place where
it costs nothing: the GPU has a block of ``engine.sync_every`` steps queued ahead (~40 ms at 0.5B) while
the host waits on events, so a launch held up for one locking call still finds the GPU busy.

The engine opens the window around that loop (``with window.opened():``); the background work calls
``wait(timeout)`` before each piece. Nothing else runs on the devices of a colocated rank meanwhile: the
phase controller drains every generate call before a train step begins.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager


class HostIdleWindow:
    def __init__(self):
        self._open = threading.Event()

    @contextmanager
    def opened(self):
        self._open.set()
        try:
            yield
        finally:
            self._open.clear()

    def wait(self, timeout: float) -> bool:
        """True once the window is open (at once if it is), False after ``timeout`` seconds closed."""
        return self._open.wait(timeout)

    def is_open(self) -> bool:
        return self._open.is_set()
