"""``streamrft serve-reward``: a reward function behind ZeroMQ (and optionally HTTP).

    streamrft serve-reward --fn SPEC --bind tcp://127.0.0.1:5555 --workers 4 [--http 127.0.0.1:8000]
    python -m streamrft.rewards.service --fn arith --bind tcp://127.0.0.1:0

SPEC is a rule name (arith, gsm8k, math, boxed_format) or ``module:function`` /
``path/to/file.py:function`` (see streamrft.rewards.custom). ``--convention trl|verl|openrlhf|auto`` serves a
custom function written for TRL, verl or OpenRLHF unchanged (streamrft.rewards.conventions; default
``streamrft``, whose refusal of another convention's signature names the flag to set).

ZeroMQ: a ROUTER socket speaking protocols.RewardRequest -> RewardReply (msgpack, never pickle). The
last frame of a message is the request; the frames before it are the envelope sent back unchanged,
so DEALER and REQ peers both work. A malformed frame or a protocol-version mismatch gets an error
reply naming the problem; the service keeps running.

Workers: ``--workers N`` scoring threads. At most N requests are scored at once, and sync functions
run on a pool of N threads (async functions run on the event loop). Threads share the GIL: for a
CPU-heavy pure-Python function, run several services on different ports instead.

Bounds (every one a flag; a request past one gets an error reply, never a hang):
- ``--max-message-bytes`` (16 MiB): the largest request frame / HTTP body; ZeroMQ drops a frame over
  twice that before it is read (the sender's connection is reset, its request times out).
- ``--max-items`` (4096): samples per request.
- ``--max-queued`` (256) and ``--max-queued-bytes`` (256 MiB): requests received and not yet answered;
  past either the reply is ``busy: ...`` (HTTP 503) at once, so memory stays bounded.
- ``--score-timeout-s`` (60): a request whose function has not returned by then is answered
  ``scoring timed out ...`` (HTTP 504). A sync function stuck in its thread keeps that thread, but a
  fresh one takes its place, so other clients go on; at most ``3 * workers`` stuck threads are kept,
  after which requests are answered with that error at once. Stuck threads never delay exit.
- ``--http-timeout-s`` (30): an HTTP client that does not send its headers and body within it is
  disconnected (HTTP 408 when it sent headers); at most ``--max-queued`` HTTP connections are served
  at once (more get 503), with a listen backlog of 128.

Idempotency: replies are cached by (request_id, hash of the items), the newest ones within
``--cache-bytes`` (64 MiB); a retried request is answered from the cache, and one that arrives while
its first copy is still being scored waits for that result. Nothing is scored twice within one
service lifetime; an id reused for different items is scored as the new request it is. The cache lives
in memory, so after a restart a retried request is scored again (at-least-once across restarts).

HTTP (``--http host:port``): POST any path with JSON ``{"queries": [...], "prompts": [...],
"references": [...], "labels": [...], "request_id": "..."}`` and get ``{"rewards": [...]}``; or OpenRLHF's
remote-RM body ``{"query": [...], "prompts": [...], "labels": [...]}`` (labels = gold answers, used as the
references) and get ``{"rewards": [...], "scores": [...]}``.
``queries`` are prompt + response texts (the OpenRLHF convention); when ``prompts[i]`` is a prefix
of ``queries[i]`` the response is the rest, otherwise the whole query is the response. ``prompts``,
``labels`` and ``request_id`` are optional; ``references`` too, unless the function needs them (the
arith, gsm8k and math rules, or a custom function with ``needs_reference = True``): then one non-empty
string per query is required. A sample whose function failed gets ``null``; a request that failed as a
whole gets HTTP 4xx/5xx with ``{"error": "..."}``. ``GET /health`` answers ``{"status": "ok", ...}``;
every other GET, an unknown method or a malformed request gets a JSON error too.

The service prints ``serve-reward: listening on <address>`` for each bound address, then
``serve-reward: ready``; launchers wait for that line. SIGTERM / SIGINT stop it cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import json
import math
import queue
import sys
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from protocols import MediaRef, ProtocolError, RewardItem, RewardReply, RewardRequest, decode, encode
from streamrft.rewards.conventions import CONVENTIONS
from streamrft.rewards.custom import BatchRewardError, RewardFunction
from streamrft.rewards.remote import peek_request_id
from streamrft.rewards.sources import resolve_reward_function
from streamrft.serving import (
    BUSY,
    QueueBound,
    bind_router,
    check_bind,
    check_limits,
    json_http_handler,
    parse_http,
    run_until_signal,
    serve_router,
    start_http,
    stop_http,
)

STUCK_THREADS_PER_WORKER = 3  # sync calls past the timeout kept running (they cannot be killed) per worker
TIMED_OUT = "scoring timed out"
# Rules that compare with the reference; a custom function says so with ``fn.needs_reference = True``.
REFERENCE_RULES = ("arith", "gsm8k", "math")


@dataclass(frozen=True)
class ServiceLimits:
    """The bounds of one service (see the module docstring); the CLI flags have the same names."""

    max_message_bytes: int = 16 * 1024 * 1024
    max_items: int = 4096
    max_queued: int = 256
    max_queued_bytes: int = 256 * 1024 * 1024
    score_timeout_s: float = 60.0
    http_timeout_s: float = 30.0
    cache_bytes: int = 64 * 1024 * 1024

    def check(self) -> None:
        at_least_one = ("max_message_bytes", "max_items", "max_queued", "max_queued_bytes")
        check_limits(self, {**dict.fromkeys(at_least_one, 1), "cache_bytes": 0}, ("score_timeout_s", "http_timeout_s"))


class _ScoringThreads(concurrent.futures.ThreadPoolExecutor):
    """The executor of the service's sync reward calls: ``workers`` daemon threads, and a new one for
    each thread whose call has run past ``stuck_after_s``.

    A Python thread cannot be killed. A ThreadPoolExecutor would keep a hung call's thread forever,
    so two hung requests would block every client, and its shutdown (and interpreter exit) would
    wait for them. Here a stuck thread is written off: a fresh thread serves the queue, and since all
    threads are daemons a stuck one never delays exit. At most ``max_stuck`` are written off.
    (A ThreadPoolExecutor subclass only because asyncio's set_default_executor insists on one: every
    method it uses is replaced here, so none of its threads is ever started.)
    """

    def __init__(self, workers: int, stuck_after_s: float, max_stuck: int) -> None:
        super().__init__(max_workers=1, thread_name_prefix="unused")
        self.workers, self.stuck_after_s, self.max_stuck = workers, stuck_after_s, max_stuck
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started: dict[threading.Thread, float | None] = {}  # thread -> start of its current call
        self._shutdown = False

    def stuck(self) -> int:
        """Threads whose call has run past ``stuck_after_s``."""
        now = time.monotonic()
        with self._lock:
            return sum(1 for t, s in self._started.items() if t.is_alive() and s is not None and now - s > self.stuck_after_s)

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        if self._shutdown:
            raise RuntimeError("the scoring threads are shut down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args, kwargs))
        self.replace_stuck()
        return future

    def replace_stuck(self) -> None:
        """Start threads until ``workers`` of them are not stuck (bounded by ``max_stuck``).

        A call counts as stuck here after half the timeout: the request that gave up on it measured its
        timeout from before the call began, so at that moment the call itself has run a little less."""
        now = time.monotonic()
        with self._lock:
            for t in [t for t in self._started if not t.is_alive()]:
                del self._started[t]
            healthy = sum(1 for s in self._started.values() if s is None or now - s <= self.stuck_after_s / 2)
            while healthy < self.workers and len(self._started) < self.workers + self.max_stuck:
                thread = threading.Thread(target=self._work, name="reward-worker", daemon=True)
                self._started[thread] = None
                thread.start()
                healthy += 1

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            job = self._queue.get()
            if job is None:
                return
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue  # its request timed out while it waited
            with self._lock:
                self._started[me] = time.monotonic()
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to the awaiting coroutine, as ThreadPoolExecutor does
                future.set_exception(exc)
            finally:
                with self._lock:
                    if me in self._started:
                        self._started[me] = None

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Idle threads end; a thread still in a call is left to die with the process (it is a daemon)."""
        self._shutdown = True
        with self._lock:
            n = len(self._started)
        for _ in range(n):
            self._queue.put(None)


def _needs_reference(fn: Any) -> bool:
    inner = getattr(fn, "fn", None)
    if inner is not None and hasattr(inner, "needs_reference"):
        return bool(inner.needs_reference)
    if hasattr(fn, "needs_reference"):
        return bool(fn.needs_reference)
    return getattr(fn, "name", "") in REFERENCE_RULES


_items_encoder = msgspec.msgpack.Encoder()


def _log(msg: str) -> None:
    print(f"serve-reward: {msg}", flush=True)


class RewardService:
    """Scores RewardRequests with one reward function; idempotent by (request_id, content); bounded."""

    def __init__(self, fn: RewardFunction, workers: int = 1, log_requests: bool = False,
                 limits: ServiceLimits | None = None, threads: _ScoringThreads | None = None) -> None:
        self.fn = fn
        self.workers = workers
        self.log_requests = log_requests
        self.limits = limits or ServiceLimits()
        self.threads = threads  # the executor of sync calls, when this service owns one
        self.needs_reference = _needs_reference(fn)
        self._slots = asyncio.Semaphore(workers)
        self._cache: OrderedDict[tuple[str, bytes], tuple[RewardReply, int]] = OrderedDict()
        self._cache_bytes = 0
        self._pending: dict[tuple[str, bytes], asyncio.Future[RewardReply]] = {}
        self.queue = QueueBound(self.limits.max_queued, self.limits.max_queued_bytes, doing="scored")
        self.n_requests = 0  # requests received (retries included)
        self.n_scored = 0  # requests actually scored
        self.n_cached = 0  # retries answered from the cache or joined to a request being scored
        self.n_errors = 0  # error replies (bad frames, failed functions, busy, timeouts)
        self.n_timeouts = 0  # requests whose scoring passed --score-timeout-s
        self.n_item_failures = 0  # samples whose function raised or returned a non-finite value

    # --- admission: bounded queue (streamrft.serving.QueueBound) --------------------------------

    @property
    def queued(self) -> int:
        return self.queue.queued  # requests received and not yet answered

    @property
    def queued_bytes(self) -> int:
        return self.queue.queued_bytes

    @property
    def n_busy(self) -> int:
        return self.queue.n_busy  # requests refused because the queue was full

    def admit(self, nbytes: int) -> str:
        """Count one request of ``nbytes`` as queued; "" when admitted, else the busy error message."""
        return self.queue.admit(nbytes)

    def release(self, nbytes: int) -> None:
        self.queue.release(nbytes)

    # --- scoring ---------------------------------------------------------------------------------

    def _check(self, request: RewardRequest) -> str:
        if len(request.items) > self.limits.max_items:
            return f"request has {len(request.items)} items, the limit is --max-items={self.limits.max_items}"
        stuck = self.threads.stuck() if self.threads is not None else 0
        if stuck >= self.workers * STUCK_THREADS_PER_WORKER:
            return (f"{TIMED_OUT}: {stuck} calls of {self.fn.name} are stuck past --score-timeout-s="
                    f"{self.limits.score_timeout_s}; the function hangs, restart the service once it is fixed")
        return ""

    async def handle(self, request: RewardRequest) -> RewardReply:
        self.n_requests += 1
        rid = request.request_id
        problem = self._check(request)
        if problem:
            return self._error(rid, problem)
        # The key holds the content: a reused id with other items is another request, not a retry.
        key = (rid, hashlib.blake2b(_items_encoder.encode(request.items), digest_size=16).digest())
        hit = self._cache.get(key)
        if hit is not None:
            self.n_cached += 1
            self._cache.move_to_end(key)
            return hit[0]
        if key in self._pending:
            self.n_cached += 1
            return await asyncio.shield(self._pending[key])
        future: asyncio.Future[RewardReply] = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            reply = await self._score(request)
        except asyncio.CancelledError:
            future.cancel()  # a retry joined to this one must not wait forever
            raise
        except Exception as exc:  # an unexpected bug: answer with it rather than leave the peer waiting
            reply = self._error(rid, f"{type(exc).__name__}: {exc}")
        finally:
            del self._pending[key]
        self._remember(key, reply)
        future.set_result(reply)
        return reply

    def _remember(self, key: tuple[str, bytes], reply: RewardReply) -> None:
        size = len(key[0]) + 8 * len(reply.rewards) * (1 + len(reply.components)) + len(reply.error) + 200
        self._cache[key] = (reply, size)
        self._cache_bytes += size
        while self._cache_bytes > self.limits.cache_bytes and self._cache:
            self._cache_bytes -= self._cache.popitem(last=False)[1][1]

    async def _score(self, request: RewardRequest) -> RewardReply:
        timeout_s = self.limits.score_timeout_s
        async with self._slots:
            if self.log_requests:
                _log(f"scoring request {request.request_id} ({len(request.items)} items)")
            self.n_scored += 1
            try:
                async with asyncio.timeout(timeout_s):
                    values = await self.fn.score(request.items)
            except TimeoutError:
                self.n_timeouts += 1
                if self.threads is not None:
                    self.threads.replace_stuck()  # its thread, if any, still runs the call: bring a fresh one
                message = f"{TIMED_OUT} after --score-timeout-s={timeout_s} ({self.fn.name}, {len(request.items)} items)"
                _log(f"request {request.request_id}: {message}")
                return self._error(request.request_id, message)
        if values and isinstance(values[0], BatchRewardError):  # the whole batch failed: say so once
            _log(f"request {request.request_id}: {values[0]}")
            return self._error(request.request_id, str(values[0]))
        rewards = []
        for item, value in zip(request.items, values):
            if isinstance(value, Exception) or not math.isfinite(value):
                self.n_item_failures += 1
                why = f"{type(value).__name__}: {value}" if isinstance(value, Exception) else f"returned {value}"
                _log(f"request {request.request_id} sample {item.sample_id!r}: {self.fn.name} {why}")
                rewards.append(math.nan)
            else:
                rewards.append(float(value))
        return RewardReply(request_id=request.request_id, rewards=rewards, components={self.fn.name: rewards})

    def _error(self, request_id: str, message: str) -> RewardReply:
        self.n_errors += 1
        return RewardReply(request_id=request_id, error=message)

    def reject_frame(self, payload: bytes) -> bytes | None:
        """The error reply for a frame refused before any decoding (too large, queue full), else None.
        A None frame has been admitted: its answer must end with ``release(len(payload))``."""
        limit = self.limits.max_message_bytes
        if len(payload) > limit:
            rid = ""  # not even peeked: reading a frame this size is what the limit prevents
            _log(f"rejected a request of {len(payload)} bytes (--max-message-bytes={limit})")
            return encode(self._error(rid, f"request of {len(payload)} bytes exceeds --max-message-bytes={limit}"))
        busy = self.admit(len(payload))
        if busy:
            return encode(self._error(peek_request_id(payload), busy))
        return None

    async def answer_frame(self, payload: bytes) -> bytes:
        """One request frame in, one reply frame out; a bad frame gets an error reply, never an exception."""
        try:
            request = decode(payload, RewardRequest, max_bytes=self.limits.max_message_bytes)
        except ProtocolError as exc:  # includes ProtocolVersionError
            rid = peek_request_id(payload)
            _log(f"rejected request {rid or '?'}: {exc}")
            return encode(self._error(rid, str(exc)))
        return encode(await self.handle(request))


def _http_handler(service: RewardService, loop: asyncio.AbstractEventLoop) -> type:
    limits = service.limits
    # A request waits for a scoring slot behind at most max_queued others, each bounded by the timeout.
    wait_s = limits.score_timeout_s * (1 + limits.max_queued / service.workers) + 5.0

    def count_error() -> None:
        service.n_errors += 1

    def health() -> dict:
        return {"fn": service.fn.name, "workers": service.workers, "queued": service.queued,
                "queued_bytes": service.queued_bytes, "requests": service.n_requests, "errors": service.n_errors,
                "stuck_threads": service.threads.stuck() if service.threads else 0}

    def post(raw: bytes) -> tuple[int, dict]:
        try:
            request, openrlhf = _parse_body(raw, service.needs_reference, service.fn.name)
        except ValueError as exc:
            service.n_errors += 1
            return 400, {"error": str(exc)}
        future = asyncio.run_coroutine_threadsafe(service.handle(request), loop)
        try:
            reply = future.result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return 504, {"error": f"no reply within {wait_s:.0f}s"}
        except RuntimeError as exc:  # the loop is shutting down
            return 503, {"error": f"the service is stopping: {exc}"}
        if reply.error:
            status = 503 if reply.error.startswith(BUSY) else 504 if reply.error.startswith(TIMED_OUT) else 500
            if reply.error.startswith("request has "):
                status = 413
            return status, {"error": reply.error}
        rewards = [None if math.isnan(r) else r for r in reply.rewards]
        # OpenRLHF's client reads "rewards" (advantages) and "scores" (dynamic filtering); both are the reward.
        return 200, {"rewards": rewards, "scores": rewards} if openrlhf else {"rewards": rewards}

    return json_http_handler(max_message_bytes=limits.max_message_bytes, http_timeout_s=limits.http_timeout_s,
                             queue=service.queue, health=health, post=post, count_error=count_error,
                             what="POST a JSON body to score")


def _request_from_json(raw: bytes, needs_reference: bool = False, fn_name: str = "the reward function") -> RewardRequest:
    """Parse the HTTP body; ValueError (and nothing else, for any bytes) names the field that is wrong."""
    return _parse_body(raw, needs_reference, fn_name)[0]


def _from_openrlhf(body: Any, needs_reference: bool, fn_name: str) -> tuple[Any, bool]:
    """OpenRLHF's remote-RM body ``{"query": [...], "prompts": [...], "labels": [...]}`` (labels are gold
    answers; the oldest clients send ``query`` alone) as this service's body, and whether it was one."""
    if not isinstance(body, dict) or "queries" in body or "query" not in body:
        return body, False
    queries = body["query"]
    if not isinstance(queries, list):
        raise ValueError('"query" must be a list of prompt+response strings (the OpenRLHF body)')
    if needs_reference and "labels" not in body:
        raise ValueError(f'{fn_name} compares with a reference: the OpenRLHF body needs "labels" (the gold answers), '
                         "one per query")
    labels = body.get("labels", [""] * len(queries))
    if isinstance(labels, list):  # a label that is not text is refused below, by the "references" check
        labels = ["" if v is None else v for v in labels]
        if needs_reference and "" in labels:
            raise ValueError(f'{fn_name} compares with a reference: "labels"[{labels.index("")}] is empty '
                             "(OpenRLHF's labels are the gold answers)")
        if len(labels) != len(queries) or not all(isinstance(v, str) for v in labels):
            raise ValueError(f'"labels" must be a list of {len(queries)} strings (the gold answers, one per query)')
    translated = {"queries": queries, "references": labels}
    if "prompts" in body:
        translated["prompts"] = body["prompts"]
    return translated, True


def _http_media(value, n: int) -> list[list[MediaRef]]:
    """``"media"``: one list per query of media by reference, ``{"path", "sha256", "kind"}`` (protocols.MediaRef;
    the files are read by a media reward model, never sent)."""
    try:
        out = msgspec.convert(value, list[list[MediaRef]])
    except msgspec.ValidationError as exc:
        raise ValueError(f'"media" must be a list of {n} lists of {{"path", "sha256", "kind"}} objects '
                         f"(one list per query): {exc}") from None
    if len(out) != n:
        raise ValueError(f'"media" has {len(out)} lists for {n} queries; give one list per query')
    return out


def _parse_body(raw: bytes, needs_reference: bool, fn_name: str) -> tuple[RewardRequest, bool]:
    """The request of an HTTP body, and whether it came in OpenRLHF's shape (answered with "scores" too)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ValueError("body is not JSON this service reads: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer too long to convert
        raise ValueError(f"body is not JSON: {exc}") from None
    body, openrlhf = _from_openrlhf(body, needs_reference, fn_name)
    if not isinstance(body, dict) or not isinstance(body.get("queries"), list):
        raise ValueError('body must be an object with "queries": a list of prompt+response strings')
    queries = body["queries"]
    n = len(queries)
    if not all(isinstance(q, str) for q in queries):
        raise ValueError('"queries" must hold strings')
    if needs_reference and "references" not in body:
        raise ValueError(f'{fn_name} compares with a reference: the body needs "references", one per query')
    fields = {}
    for key, default in (("prompts", ""), ("references", ""), ("labels", "default")):
        value = body.get(key, [default] * n)
        if not isinstance(value, list) or len(value) != n or not all(isinstance(v, str) for v in value):
            raise ValueError(f'"{key}" must be a list of {n} strings (one per query)')
        fields[key] = value
    if needs_reference and not all(fields["references"]):
        empty = fields["references"].index("")
        raise ValueError(f'{fn_name} compares with a reference: "references"[{empty}] is empty')
    images = body.get("images", [[] for _ in range(n)])
    if not isinstance(images, list) or len(images) != n or not all(
        isinstance(v, list) and all(isinstance(b, str) for b in v) for v in images
    ):
        raise ValueError(f'"images" must be a list of {n} lists of base64 strings (one list per query)')
    media = _http_media(body.get("media", [[] for _ in range(n)]), n)
    request_id = body.get("request_id") or f"http-{uuid.uuid4().hex}"
    if not isinstance(request_id, str):
        raise ValueError('"request_id" must be a string')
    items = []
    for i, query in enumerate(queries):
        prompt = fields["prompts"][i]
        response = query[len(prompt):] if prompt and query.startswith(prompt) else query
        items.append(RewardItem(sample_id=str(i), prompt=prompt, response=response,
                                reference=fields["references"][i], label=fields["labels"][i], images=images[i],
                                media=media[i]))
    request = RewardRequest(request_id=request_id, items=items)
    try:  # JSON may spell a lone surrogate ("\\ud800"), which no UTF-8 wire (nor the cache key) can carry
        _items_encoder.encode(request)
    except UnicodeEncodeError as exc:
        raise ValueError(f"body holds a string that is not valid Unicode: {exc}") from None
    return request, openrlhf


async def _serve(fn: RewardFunction, bind: str, workers: int, http: str | None, log_requests: bool,
                 stop: asyncio.Event, limits: ServiceLimits) -> RewardService:
    loop = asyncio.get_running_loop()
    threads = _ScoringThreads(workers, limits.score_timeout_s, workers * STUCK_THREADS_PER_WORKER)
    loop.set_default_executor(threads)
    service = RewardService(fn, workers, log_requests, limits, threads)
    ctx = zmq.asyncio.Context()
    sock: zmq.asyncio.Socket | None = None
    server = http_thread = None
    try:
        sock = bind_router(ctx, bind, limits.max_message_bytes)
        _log(f"listening on {sock.getsockopt_string(zmq.LAST_ENDPOINT)}")
        if http:
            server, http_thread = start_http(http, _http_handler(service, loop), limits.max_queued, "reward-http")
            _log(f"listening on http://{server.server_address[0]}:{server.server_address[1]}")
        _log(f"ready (fn={fn.name}, workers={workers}, score_timeout_s={limits.score_timeout_s})")
        await serve_router(service, sock, stop, _log)
    finally:
        stop_http(server, http_thread)
        if sock is not None:
            sock.close(linger=0)
        ctx.term()
    return service


def serve_reward(fn_spec: str, bind: str = "tcp://127.0.0.1:0", workers: int = 1, http: str | None = None,
                 log_requests: bool = False, limits: ServiceLimits | None = None, convention: str = "streamrft") -> None:
    """Serve ``fn_spec`` until SIGTERM / SIGINT (blocking). Raises ValueError for a bad spec, address or limit.
    ``convention``: how a custom function is called (``--convention``: streamrft, trl, verl, openrlhf, auto),
    so a function written for TRL, verl or OpenRLHF is served unchanged."""
    limits = limits or ServiceLimits()
    if workers < 1:
        raise ValueError(f"--workers={workers} must be >= 1")
    limits.check()
    check_bind(bind)
    if http:
        parse_http(http)
    fn = resolve_reward_function(fn_spec, convention)
    service, reason = run_until_signal(lambda stop: _serve(fn, bind, workers, http, log_requests, stop, limits))
    _log(
        f"stopped on {reason}: {service.n_requests} requests, "
        f"{service.n_scored} scored, {service.n_cached} from cache, {service.n_errors} errors, "
        f"{service.n_busy} busy, {service.n_timeouts} timed out, {service.n_item_failures} failed samples"
    )


def serve_reward_main(argv: list[str]) -> int:
    """Entry of ``streamrft serve-reward``; returns the exit status."""
    d = ServiceLimits()
    parser = argparse.ArgumentParser(prog="streamrft serve-reward", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fn", required=True, help="rule name (arith, gsm8k, math, boxed_format) or module:function")
    parser.add_argument("--convention", default="streamrft", choices=[*CONVENTIONS, "auto"],
                        help="calling convention of a custom --fn (as reward.sources[].convention): a TRL, verl or "
                             "OpenRLHF reward function is served unchanged")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="ZeroMQ address; port 0 = any free port")
    parser.add_argument("--workers", type=int, default=1, help="concurrent scoring threads")
    parser.add_argument("--http", default=None, help="also serve JSON over HTTP on host:port")
    parser.add_argument("--log-requests", action="store_true", help="log one line per request scored")
    parser.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes,
                        help="largest request frame or HTTP body")
    parser.add_argument("--max-items", type=int, default=d.max_items, help="most samples in one request")
    parser.add_argument("--max-queued", type=int, default=d.max_queued,
                        help="requests waiting or being scored before new ones get a busy reply")
    parser.add_argument("--max-queued-bytes", type=int, default=d.max_queued_bytes,
                        help="bytes of requests waiting or being scored before new ones get a busy reply")
    parser.add_argument("--score-timeout-s", type=float, default=d.score_timeout_s,
                        help="a request not scored within this gets an error reply")
    parser.add_argument("--http-timeout-s", type=float, default=d.http_timeout_s,
                        help="an HTTP client must send its request within this")
    parser.add_argument("--cache-bytes", type=int, default=d.cache_bytes, help="memory for replies kept for retries")
    args = parser.parse_args(argv)
    limits = ServiceLimits(
        max_message_bytes=args.max_message_bytes, max_items=args.max_items, max_queued=args.max_queued,
        max_queued_bytes=args.max_queued_bytes, score_timeout_s=args.score_timeout_s,
        http_timeout_s=args.http_timeout_s, cache_bytes=args.cache_bytes,
    )
    try:
        serve_reward(args.fn, args.bind, args.workers, args.http, args.log_requests, limits, args.convention)
    except (ValueError, zmq.ZMQError, OSError) as exc:
        print(f"serve-reward: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(serve_reward_main(sys.argv[1:]))
