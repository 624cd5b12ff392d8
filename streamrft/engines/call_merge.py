"""Concurrent generate() calls on one static-cache engine share chunks (the async placement's engine).

The Generator admits prompt groups as credits come back, one ``generate()`` call per admission: in the async
placement that is one group of 8 rows at a time once the first wave is out. A static-cache chunk runs until its
longest row ends and chunks run one at a time (each owns the KV cache and the CUDA graphs), so calls that queue
behind a running chunk would each run alone, and on long-tailed lengths each would pay a whole tail at a batch of 8:
187 s a step at 0.5B instead of ~15 s (v19 in benchmarks/NOTES.md). Here the calls waiting when a chunk ends are
merged into the next one, up to ``max_rows`` rows, first come first served; each call still receives exactly its
own samples, as soon as each ends.

A row's tokens do not depend on the batch it decodes in (per-request seeds), but the batch size can change a bf16
GEMM's rounding; merging depends on timing, so the colocated engine (whose rollouts must repeat exactly) keeps
one chunk per call and only engines with their own weights merge (``HFEngine``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import time
from typing import AsyncIterator, Callable

from streamrft.engines.base import GeneratedSample, GenerationRequest

RunChunk = Callable[[list[GenerationRequest]], AsyncIterator[GeneratedSample]]
_END = object()  # a call's last item: every one of its rows has left its chunk, and that chunk is closed


@dataclasses.dataclass(eq=False)
class _Call:
    queued: list[GenerationRequest]  # rows not yet in a chunk
    start: float
    out: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    closed: bool = False  # the caller stopped listening: its rows are dropped


class CallMerger:
    """Runs ``run_chunk`` on the rows of every call waiting when the previous chunk ends: at most ``max_rows``,
    and of those the first ``chunk_rows(waiting rows)`` (the rows that fit in memory; all when None)."""

    def __init__(self, run_chunk: RunChunk, max_rows: int,
                 chunk_rows: Callable[[list[GenerationRequest]], int] | None = None):
        self._run_chunk = run_chunk
        self._max_rows = max_rows
        self._chunk_rows = chunk_rows
        self._waiting: collections.deque[_Call] = collections.deque()
        self._driver: asyncio.Task | None = None
        self._feeding: asyncio.Task | None = None  # the running chunk's feed
        self._owners: dict[str, _Call] = {}  # request id -> call, for the running chunk's rows
        self.chunks_run = 0  # chunks started (tests, logs)

    async def generate(self, requests: list[GenerationRequest]) -> AsyncIterator[GeneratedSample]:
        """This call's samples, each as soon as it ends; errors of a chunk holding its rows are raised here."""
        in_flight = set(self._owners).union(r.request_id for c in self._waiting for r in c.queued)
        for r in requests:
            if r.request_id in in_flight:  # their samples would go to whichever call holds the id
                raise ValueError(f"generate(): request id {r.request_id!r} is already in flight in another "
                                 "generate() call on this engine; request ids must be unique among calls in flight")
        call = _Call(list(requests), time.perf_counter())
        self._waiting.append(call)
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive(), name="engine-call-merger")
        try:
            while (item := await call.out.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._close(call)

    def _close(self, call: _Call) -> None:
        call.closed = True
        call.queued = []
        if self._feeding is not None and self._owners and all(c.closed for c in self._owners.values()):
            self._feeding.cancel()  # nobody wants the running chunk's rows any more

    def _next_rows(self) -> list[GenerationRequest]:
        limit = self._max_rows
        if self._chunk_rows is not None:
            limit = self._chunk_rows(list(itertools.islice(
                itertools.chain.from_iterable(c.queued for c in self._waiting), self._max_rows)))
        rows: list[GenerationRequest] = []
        while self._waiting and len(rows) < limit:
            call = self._waiting[0]
            room = limit - len(rows)
            take, call.queued = call.queued[:room], call.queued[room:]
            self._owners.update((r.request_id, call) for r in take)
            rows += take
            if not call.queued:
                self._waiting.popleft()
        return rows

    async def _drive(self) -> None:
        try:
            while self._waiting:
                self._owners = {}
                try:
                    rows = self._next_rows()
                except Exception as exc:  # no chunk can take the next rows (one does not fit in memory)
                    for call in list(self._waiting):
                        self._fail(call, exc)
                    break
                if not rows:
                    continue
                self.chunks_run += 1
                self._feeding = asyncio.create_task(self._feed(rows), name="engine-call-merger-chunk")
                await asyncio.wait({self._feeding})
                error = None if self._feeding.cancelled() else self._feeding.exception()
                for call in set(self._owners.values()):
                    if error is not None:
                        self._fail(call, error)
                    elif not call.queued:
                        call.out.put_nowait(_END)
                self._feeding = None
        except BaseException as exc:  # the driver itself was cancelled: nobody would answer the callers
            if self._feeding is not None:
                self._feeding.cancel()
            stopped = RuntimeError(f"generate(): the engine's chunk runner stopped ({type(exc).__name__})")
            for call in {*self._owners.values(), *self._waiting}:
                self._fail(call, stopped)
            raise
        finally:
            self._owners = {}

    def _fail(self, call: _Call, error: BaseException) -> None:
        if call in self._waiting:
            self._waiting.remove(call)
        call.queued = []
        call.out.put_nowait(error)

    async def _feed(self, rows: list[GenerationRequest]) -> None:
        chunk = self._run_chunk(rows)
        try:
            async for sample in chunk:
                call = self._owners[sample.request_id]
                if not call.closed:
                    call.out.put_nowait(dataclasses.replace(sample, seconds=time.perf_counter() - call.start))
        finally:
            await chunk.aclose()
