"""Run trajectory sinks on a writer thread, so serialisation overlaps the next step's compute.

Encoding a record (JSON, Arrow, msgpack) costs ~0.1-0.3 ms per 256-token sample; on the training
thread that is a few percent of a short step. torch kernels release the GIL, so a writer thread
does this work while the step computes. ``flush`` is queued, not awaited; ``close`` drains the
queue. An exception in a sink is re-raised on the training thread at the next call, with the sink
named: a failing sink is never silently dropped. A sink that hangs (a stuck network file system) is
not waited for forever either: once the queue is full, a write that finds no room for ``WAIT_S``
raises, naming the sinks, as do ``drain`` and ``close``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

from protocols import TrajectoryRecord
from streamrft.sinks.base import TrajectorySink

_FLUSH = object()
_STOP = object()
WAIT_S = 600.0  # the longest the training thread waits for the writer thread (room in the queue, a drain)


class BackgroundSinks:
    """One TrajectorySink that forwards to ``sinks`` from a daemon thread (queue of ``max_queued``)."""

    def __init__(self, sinks: Sequence[TrajectorySink], max_queued: int = 100_000, wait_s: float = WAIT_S):
        self.sinks = list(sinks)
        self.wait_s = wait_s
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)  # bounded: backpressure, not OOM
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="trajectory-sinks", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if self._error is None:  # after an error keep draining: producers never block
                    self._forward(item)
            finally:
                self._queue.task_done()

    def _forward(self, item: object) -> None:
        for sink in self.sinks:
            try:
                sink.flush() if item is _FLUSH else sink.write(item)
            except BaseException as exc:  # reported to the training thread by _raise_if_failed
                self._error = RuntimeError(f"trajectory sink {type(sink).__name__} failed: {exc!r}")
                self._error.__cause__ = exc
                return

    def drain(self) -> None:
        """Block until everything queued so far has been handed to the sinks (benchmarks, tests)."""
        with self._queue.all_tasks_done:
            if not self._queue.all_tasks_done.wait_for(lambda: self._queue.unfinished_tasks == 0, self.wait_s):
                raise self._stuck(f"{self._queue.unfinished_tasks} record(s) still queued after {self.wait_s:g} s")
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _stuck(self, what: str) -> RuntimeError:
        names = ", ".join(type(sink).__name__ for sink in self.sinks)
        return RuntimeError(f"trajectory sink writer thread is stuck in a sink ({names}): {what}")

    def _put(self, item: object) -> None:
        try:
            self._queue.put(item, timeout=self.wait_s)
        except queue.Full:
            raise self._stuck(f"its queue of {self._queue.maxsize} has had no room for {self.wait_s:g} s") from None

    def write(self, record: TrajectoryRecord) -> None:
        self._raise_if_failed()
        self._put(record)

    def flush(self) -> None:
        self._raise_if_failed()
        self._put(_FLUSH)

    def close(self, timeout: float = 60.0) -> None:
        if self._thread.is_alive():
            self._put(_STOP)
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise self._stuck(f"did not drain within {timeout:g} s")
        for sink in self.sinks:
            sink.close()
        self._raise_if_failed()
