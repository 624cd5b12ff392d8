"""``streamrft serve-reward``: a reward function behind ZeroMQ (and optionally HTTP).

    streamrft serve-reward --fn SPEC --bind tcp://127.0.0.1:5555 --workers 4 [--http 127.0.0.1:8000]
    python -m streamrft.rewards.service --fn arith --bind tcp://127.0.0.1:0

SPEC is a rule name (arith, gsm8k, math, boxed_format) or ``module:function`` /
``path/to/file.py:function`` (see streamrft.rewards.custom).

ZeroMQ: a ROUTER socket speaking protocols.RewardRequest -> RewardReply (msgpack, never pickle). The
last frame of a message is the request; the frames before it are the envelope sent back unchanged,
so DEALER and REQ peers both work. A malformed frame or a protocol-version mismatch gets an error
reply naming the problem; the service keeps running.

Workers: ``--workers N`` scoring threads. At most N requests are scored at once, and sync functions
run on a pool of N threads (async functions run on the event loop). Threads share the GIL: for a
CPU-heavy pure-Python function, run several services on different ports instead.

Idempotency: replies are cached by request_id (the newest ``CACHE_SIZE``); a retried id is answered
from the cache, and an id that arrives while its first copy is still being scored waits for that
result. Nothing is scored twice within one service lifetime. The cache lives in memory, so after a
restart a retried request is scored again (at-least-once across restarts).

HTTP (``--http host:port``): POST any path with JSON ``{"queries": [...], "prompts": [...],
"references": [...], "labels": [...], "request_id": "..."}`` and get ``{"rewards": [...]}``.
``queries`` are prompt + response texts (the OpenRLHF convention); when ``prompts[i]`` is a prefix
of ``queries[i]`` the response is the rest, otherwise the whole query is the response. ``prompts``,
``references``, ``labels`` and ``request_id`` are optional. A sample whose function failed gets
``null``; a request that failed as a whole gets HTTP 400/500 with ``{"error": "..."}``.

The service prints ``serve-reward: listening on <address>`` for each bound address, then
``serve-reward: ready``; launchers wait for that line. SIGTERM / SIGINT stop it cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import signal
import sys
import threading
import uuid
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import zmq
import zmq.asyncio

from protocols import ProtocolError, RewardItem, RewardReply, RewardRequest, decode, encode
from streamrft.rewards.custom import BatchRewardError, RewardFunction
from streamrft.rewards.remote import peek_request_id
from streamrft.rewards.sources import resolve_reward_function

CACHE_SIZE = 4096  # replies kept for retried request ids
SHUTDOWN_GRACE_S = 5.0  # time given to requests being scored to send their replies on shutdown


def _log(msg: str) -> None:
    print(f"serve-reward: {msg}", flush=True)


class RewardService:
    """Scores RewardRequests with one reward function; idempotent by request_id."""

    def __init__(self, fn: RewardFunction, workers: int = 1, log_requests: bool = False) -> None:
        self.fn = fn
        self.workers = workers
        self.log_requests = log_requests
        self._slots = asyncio.Semaphore(workers)
        self._cache: OrderedDict[str, tuple[int, RewardReply]] = OrderedDict()
        self._pending: dict[str, asyncio.Future[RewardReply]] = {}
        self.n_requests = 0  # requests received (retries included)
        self.n_scored = 0  # requests actually scored
        self.n_cached = 0  # retries answered from the cache or joined to a request being scored
        self.n_errors = 0  # error replies (bad frames, failed functions)
        self.n_item_failures = 0  # samples whose function raised or returned a non-finite value

    async def handle(self, request: RewardRequest) -> RewardReply:
        self.n_requests += 1
        rid = request.request_id
        hit = self._cache.get(rid)
        if hit is None and rid in self._pending:
            self.n_cached += 1
            return await asyncio.shield(self._pending[rid])
        if hit is not None:
            self.n_cached += 1
            n_items, reply = hit
            if n_items != len(request.items):
                return self._error(rid, f"request id {rid!r} was already used for a batch of {n_items} items")
            return reply
        future: asyncio.Future[RewardReply] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            reply = await self._score(request)
        except asyncio.CancelledError:
            future.cancel()  # a retry joined to this one must not wait forever
            raise
        except Exception as exc:  # an unexpected bug: answer with it rather than leave the peer waiting
            reply = self._error(rid, f"{type(exc).__name__}: {exc}")
        finally:
            del self._pending[rid]
        self._cache[rid] = (len(request.items), reply)
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        future.set_result(reply)
        return reply

    async def _score(self, request: RewardRequest) -> RewardReply:
        async with self._slots:
            if self.log_requests:
                _log(f"scoring request {request.request_id} ({len(request.items)} items)")
            self.n_scored += 1
            values = await self.fn.score(request.items)
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

    async def answer_frame(self, payload: bytes) -> bytes:
        """One request frame in, one reply frame out; a bad frame gets an error reply, never an exception."""
        try:
            request = decode(payload, RewardRequest)
        except ProtocolError as exc:  # includes ProtocolVersionError
            rid = peek_request_id(payload)
            _log(f"rejected request {rid or '?'}: {exc}")
            return encode(self._error(rid, str(exc)))
        return encode(await self.handle(request))


async def _serve_router(service: RewardService, sock: zmq.asyncio.Socket, stop: asyncio.Event) -> None:
    tasks: set[asyncio.Task] = set()

    async def answer(envelope: list[bytes], payload: bytes) -> None:
        reply = await service.answer_frame(payload)
        await sock.send_multipart([*envelope, reply])

    while not stop.is_set():
        if not await sock.poll(100, zmq.POLLIN):
            continue
        frames = await sock.recv_multipart()
        task = asyncio.create_task(answer(frames[:-1], frames[-1]))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        done, not_done = await asyncio.wait(tasks, timeout=SHUTDOWN_GRACE_S)
        for task in not_done:
            task.cancel()
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                _log(f"a reply could not be sent: {task.exception()!r}")


def _http_handler(service: RewardService, loop: asyncio.AbstractEventLoop, timeout_s: float):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:  # quiet: one line per request is noise
            return None

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            try:
                request = _request_from_json(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            except ValueError as exc:
                service.n_errors += 1
                self._send(400, {"error": str(exc)})
                return
            future = asyncio.run_coroutine_threadsafe(service.handle(request), loop)
            try:
                reply = future.result(timeout=timeout_s)
            except concurrent.futures.TimeoutError:
                future.cancel()
                self._send(504, {"error": f"scoring took longer than {timeout_s}s"})
                return
            if reply.error:
                self._send(500, {"error": reply.error})
                return
            self._send(200, {"rewards": [None if math.isnan(r) else r for r in reply.rewards]})

    return Handler


def _request_from_json(raw: bytes) -> RewardRequest:
    """Parse the HTTP body; ValueError names the field that is wrong."""
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("queries"), list):
        raise ValueError('body must be an object with "queries": a list of prompt+response strings')
    queries = body["queries"]
    n = len(queries)
    fields = {}
    for key, default in (("prompts", ""), ("references", ""), ("labels", "default")):
        value = body.get(key, [default] * n)
        if not isinstance(value, list) or len(value) != n or not all(isinstance(v, str) for v in value):
            raise ValueError(f'"{key}" must be a list of {n} strings (one per query)')
        fields[key] = value
    if not all(isinstance(q, str) for q in queries):
        raise ValueError('"queries" must hold strings')
    images = body.get("images", [[] for _ in range(n)])
    if not isinstance(images, list) or len(images) != n or not all(
        isinstance(v, list) and all(isinstance(b, str) for b in v) for v in images
    ):
        raise ValueError(f'"images" must be a list of {n} lists of base64 strings (one list per query)')
    items = []
    for i, query in enumerate(queries):
        prompt = fields["prompts"][i]
        response = query[len(prompt):] if prompt and query.startswith(prompt) else query
        items.append(RewardItem(sample_id=str(i), prompt=prompt, response=response,
                                reference=fields["references"][i], label=fields["labels"][i], images=images[i]))
    request_id = body.get("request_id") or f"http-{uuid.uuid4().hex}"
    if not isinstance(request_id, str):
        raise ValueError('"request_id" must be a string')
    return RewardRequest(request_id=request_id, items=items)


def _parse_http(http: str) -> tuple[str, int]:
    hostport = http.removeprefix("http://").rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--http {http!r} must be host:port, e.g. 127.0.0.1:8000")
    return host, int(port)


async def _serve(fn: RewardFunction, bind: str, workers: int, http: str | None, log_requests: bool,
                 stop: asyncio.Event) -> RewardService:
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="reward-worker"))
    service = RewardService(fn, workers, log_requests)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    server: ThreadingHTTPServer | None = None
    http_thread: threading.Thread | None = None
    try:
        sock.bind(bind)
        _log(f"listening on {sock.getsockopt_string(zmq.LAST_ENDPOINT)}")
        if http:
            host, port = _parse_http(http)
            server = ThreadingHTTPServer((host, port), _http_handler(service, loop, timeout_s=600.0))
            server.daemon_threads = True
            http_thread = threading.Thread(target=server.serve_forever, name="reward-http", daemon=True)
            http_thread.start()
            _log(f"listening on http://{host}:{server.server_address[1]}")
        _log(f"ready (fn={fn.name}, workers={workers})")
        await _serve_router(service, sock, stop)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        if http_thread is not None:
            http_thread.join(timeout=SHUTDOWN_GRACE_S)
        sock.close(linger=0)
        ctx.term()
    return service


def serve_reward(fn_spec: str, bind: str = "tcp://127.0.0.1:0", workers: int = 1, http: str | None = None,
                 log_requests: bool = False) -> None:
    """Serve ``fn_spec`` until SIGTERM / SIGINT (blocking). Raises ValueError for a bad spec or address."""
    if workers < 1:
        raise ValueError(f"--workers={workers} must be >= 1")
    if not bind.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"--bind {bind!r} must be a ZeroMQ address such as tcp://127.0.0.1:5555")
    if http:
        _parse_http(http)
    fn = resolve_reward_function(fn_spec)

    async def main() -> None:
        stop = asyncio.Event()
        reason: list[str] = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(sig, lambda s=sig: (reason.append(s.name), stop.set()))
        service = await _serve(fn, bind, workers, http, log_requests, stop)
        _log(
            f"stopped on {reason[0] if reason else 'request'}: {service.n_requests} requests, "
            f"{service.n_scored} scored, {service.n_cached} from cache, {service.n_errors} errors, "
            f"{service.n_item_failures} failed samples"
        )

    asyncio.run(main())


def serve_reward_main(argv: list[str]) -> int:
    """Entry of ``streamrft serve-reward``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="streamrft serve-reward", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fn", required=True, help="rule name (arith, gsm8k, math, boxed_format) or module:function")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="ZeroMQ address; port 0 = any free port")
    parser.add_argument("--workers", type=int, default=1, help="concurrent scoring threads")
    parser.add_argument("--http", default=None, help="also serve JSON over HTTP on host:port")
    parser.add_argument("--log-requests", action="store_true", help="log one line per request scored")
    args = parser.parse_args(argv)
    try:
        serve_reward(args.fn, args.bind, args.workers, args.http, args.log_requests)
    except (ValueError, zmq.ZMQError, OSError) as exc:
        print(f"serve-reward: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(serve_reward_main(sys.argv[1:]))
