"""A bounded pool of daemon threads for one source's blocking user calls (sync reward functions; the
same shape fits environment and tool calls).

Why not ``asyncio.to_thread``: it uses the event loop's default executor, which the hf engine's
forwards also use. A user function that never returns would take one of its few threads per call
until the engine's forward waits forever behind them, and ``asyncio.run`` joins those threads at exit,
so even shutdown hangs. Here each source owns ``max_workers`` threads of its own:

* a hung call ties up only its source's threads; later calls of that source queue behind it and fail
  at their own deadline (the caller's ``asyncio.timeout``), the rest of the run keeps going;
* the threads are daemons and :meth:`close` never joins one inside a call, so a process with a call stuck in
  user code still exits (``concurrent.futures.ThreadPoolExecutor`` cannot do this: its threads are joined at
  interpreter exit whatever ``shutdown(wait=False)`` says); the idle ones it joins, briefly (``CLOSE_JOIN_S``),
  so they have ended before the interpreter's teardown rather than waking into it (a probe of a three-rank run
  saw nine of them still ending at exit);
* a call whose caller gave up before a thread took it is skipped, not run late.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, Callable


CLOSE_JOIN_S = 2.0  # close() waits at most this long, in all, for its idle threads to end


class BoundedExecutor:
    """``await run(fn, *args)`` runs ``fn`` in one of at most ``max_workers`` daemon threads."""

    def __init__(self, name: str, max_workers: int) -> None:
        if max_workers < 1:
            raise ValueError(f"executor {name!r}: max_workers={max_workers} must be >= 1")
        self.name = name
        self.max_workers = max_workers
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._busy: set[threading.Thread] = set()  # the threads inside a call now (close does not wait for them)
        self._idle = 0  # threads waiting for a job
        self._pending = 0  # jobs queued, not yet taken by a thread
        self._lock = threading.Lock()
        self._closed = False

    @property
    def running(self) -> int:
        """Calls inside user code now (a hung call stays counted)."""
        return len(self._busy)

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError(f"executor {self.name!r} is closed")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._pending += 1
            if self._pending > self._idle and len(self._threads) < self.max_workers:
                thread = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                self._idle += 1
                thread.start()
        self._jobs.put((loop, future, fn, args, kwargs))
        return await future

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:  # close()
                return
            loop, future, fn, args, kwargs = job
            with self._lock:
                self._pending -= 1
            if future.done():  # the caller timed out or was cancelled while the job waited
                continue
            with self._lock:
                self._idle -= 1
                self._busy.add(threading.current_thread())
            try:
                result, error = fn(*args, **kwargs), None
            except BaseException as exc:  # handed to the awaiting caller, which reports it per sample
                result, error = None, exc
            finally:
                with self._lock:
                    self._idle += 1
                    self._busy.discard(threading.current_thread())
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the loop is closed: nobody waits for this result any more
                pass

    def close(self) -> None:
        """Stop the threads: the idle ones end now (joined, at most ``CLOSE_JOIN_S`` in all); one still inside a call
        is never waited for (the call is abandoned, and its daemon thread does not keep the process alive)."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        with self._lock:
            idle = [t for t in self._threads if t not in self._busy and t is not threading.current_thread()]
        deadline = time.monotonic() + CLOSE_JOIN_S
        for thread in idle:
            thread.join(max(0.0, deadline - time.monotonic()))


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # timed out meanwhile: the late result is dropped
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
