"""What every StreamRFT request/reply service shares (serve-reward, serve-env): the bounded queue,
the ZeroMQ ROUTER socket and its serving loop, the bounded JSON-over-HTTP server, the address parsing
and the run-until-SIGTERM wrapper. Each service supplies only what it answers.

A service object handed to :func:`serve_router` has three methods:

* ``reject_frame(payload) -> bytes | None``: the reply to a frame refused before decoding (too large,
  queue full), else None, in which case the frame has been admitted and counted as queued;
* ``async answer_frame(payload) -> bytes``: one admitted request frame in, one reply frame out (never
  raises for bad input: a bad frame gets an error reply);
* ``release(nbytes)``: the admitted frame has been answered.

Imports the standard library and pyzmq only (no torch, no msgspec): a service process stays light.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Awaitable, Callable, Protocol

import zmq
import zmq.asyncio

SHUTDOWN_GRACE_S = 5.0  # time given to requests being answered to send their replies on shutdown
LISTEN_BACKLOG = 128  # HTTP connections the kernel queues before accept (socketserver's default is 5)
RCVHWM = 64  # ZeroMQ messages buffered per peer before they are read
BUSY = "busy: "  # error prefix of a request refused because the queue is full (HTTP 503)


class QueueBound:
    """Requests received and not yet answered, bounded in count and in bytes (thread-safe: admit and
    release come from the event loop and from HTTP threads). Past either bound a request is refused at
    once with a ``busy: ...`` message, so memory stays bounded whatever the clients send."""

    def __init__(self, max_queued: int, max_queued_bytes: int, doing: str = "scored") -> None:
        self.max_queued = max_queued
        self.max_queued_bytes = max_queued_bytes
        self.doing = doing  # "scored", "stepped": what the requests wait for, said in the busy message
        self.queued = 0
        self.queued_bytes = 0
        self.n_busy = 0  # requests refused because a bound was reached
        self._lock = threading.Lock()

    def admit(self, nbytes: int) -> str:
        """Count one request of ``nbytes`` as queued; "" when admitted, else the busy error message."""
        with self._lock:
            if self.queued + 1 > self.max_queued or self.queued_bytes + nbytes > self.max_queued_bytes:
                self.n_busy += 1
                return (
                    f"{BUSY}{self.queued} requests ({self.queued_bytes} bytes) are waiting to be {self.doing}; the "
                    f"limits are --max-queued={self.max_queued} and --max-queued-bytes={self.max_queued_bytes}; "
                    "retry later or start another service"
                )
            self.queued += 1
            self.queued_bytes += nbytes
            return ""

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.queued -= 1
            self.queued_bytes -= nbytes


class FrameService(Protocol):
    def reject_frame(self, payload: bytes) -> bytes | None: ...
    async def answer_frame(self, payload: bytes) -> bytes: ...
    def release(self, nbytes: int) -> None: ...


def check_limits(limits: Any, at_least: dict[str, int], positive: tuple[str, ...]) -> None:
    """ValueError naming the CLI flag of the first of a service's bounds out of range: each name of
    ``at_least`` must be >= its bound, each of ``positive`` > 0 (flags are the field names, dashed)."""
    for name, bound in at_least.items():
        if getattr(limits, name) < bound:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(limits, name)} must be >= {bound}")
    for name in positive:
        if not getattr(limits, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(limits, name)} must be > 0")


def check_bind(bind: str, example_port: int = 5555) -> None:
    if not bind.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"--bind {bind!r} must be a ZeroMQ address such as tcp://127.0.0.1:{example_port}")


def parse_http(http: str) -> tuple[str, int]:
    """``host:port`` (an ``http://`` prefix is allowed) of ``--http``; ValueError naming the flag."""
    hostport = http.removeprefix("http://").rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--http {http!r} must be host:port, e.g. 127.0.0.1:8000")
    return host, int(port)


def bind_router(ctx: zmq.asyncio.Context, bind: str, max_message_bytes: int) -> zmq.asyncio.Socket:
    """A ROUTER socket bound to ``bind`` with the bounds every service keeps."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    # The hard guard behind --max-message-bytes: a frame over twice the limit is never buffered (libzmq
    # drops the connection); one between the two is read and gets an error reply.
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes + 4096)
    # libzmq buffers up to RCVHWM messages per peer before the loop reads them (default 1000: 100 MB of
    # 100 kB requests); past it, it stops reading the peer's TCP stream, which is backpressure.
    sock.setsockopt(zmq.RCVHWM, RCVHWM)
    try:
        sock.bind(bind)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


async def serve_router(service: FrameService, sock: zmq.asyncio.Socket, stop: asyncio.Event,
                       log: Callable[[str], None]) -> None:
    """Answer every request on ``sock`` until ``stop`` is set. The last frame of a message is the
    request; the frames before it are the envelope sent back unchanged, so DEALER and REQ peers both
    work. Requests are answered concurrently (one task each); on stop, those in flight get
    SHUTDOWN_GRACE_S to reply."""
    tasks: set[asyncio.Task] = set()

    async def answer(envelope: list[bytes], payload: bytes) -> None:
        try:
            reply = await service.answer_frame(payload)
        finally:
            service.release(len(payload))
        await sock.send_multipart([*envelope, reply])

    while not stop.is_set():
        if not await sock.poll(100, zmq.POLLIN):
            continue
        frames = await sock.recv_multipart()
        refused = service.reject_frame(frames[-1])
        if refused is not None:  # answered at once: a full queue never grows
            await sock.send_multipart([*frames[:-1], refused])
            continue
        task = asyncio.create_task(answer(frames[:-1], frames[-1]))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        done, not_done = await asyncio.wait(tasks, timeout=SHUTDOWN_GRACE_S)
        for task in not_done:
            task.cancel()
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                log(f"a reply could not be sent: {task.exception()!r}")


class BoundedHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a larger backlog and at most ``max_connections`` handler threads:
    a connection past that gets a 503 JSON reply at once instead of a thread of its own."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int) -> None:
        super().__init__(address, handler)
        self._connections = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections

    def process_request(self, request, client_address) -> None:
        if not self._connections.acquire(blocking=False):
            body = json.dumps({"error": f"{BUSY}{self.max_connections} HTTP connections are open "
                                        "(--max-queued); retry later"}).encode()
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connections.release()


def json_http_handler(*, max_message_bytes: int, http_timeout_s: float, queue: QueueBound,
                      health: Callable[[], dict], post: Callable[[bytes], tuple[int, dict]],
                      count_error: Callable[[], None], what: str = "POST a JSON body") -> type:
    """A request handler class: ``GET /health`` answers ``{"status": "ok", **health()}``; a POST's body
    (bounded by ``max_message_bytes``, read within ``http_timeout_s``, admitted by ``queue``) goes to
    ``post(raw) -> (status, json body)``, which runs in the connection's thread. Every error the
    handler answers itself is JSON too, and counted with ``count_error``."""

    class Handler(BaseHTTPRequestHandler):
        timeout = http_timeout_s  # socket timeout of every read: a stalled client cannot hold a thread

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet: one line per request is noise
            return None

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            if self.request_version == "HTTP/0.9":  # a request line the stdlib could not read: reply as 1.0,
                self.request_version = "HTTP/1.0"  # since 0.9 replies carry no status line or headers
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """Every error the stdlib answers itself (bad request line, unknown method, ...) as JSON."""
            self.close_connection = True
            try:
                self._send(code, {"error": message or self.responses.get(code, ("error",))[0]})
            except OSError:
                pass

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0].rstrip("/") == "/health":
                self._send(200, {"status": "ok", **health()})
                return
            self._send(404, {"error": f"no route GET {self.path[:200]}; {what}, GET /health"})

        def do_POST(self) -> None:
            status, body = self._post()
            self._send(status, body)

        def _post(self) -> tuple[int, dict]:
            raw_length = self.headers.get("Content-Length")
            if raw_length is None:
                self.close_connection = True
                return 411, {"error": "Content-Length is required"}
            try:
                length = int(raw_length)
            except ValueError:
                length = -1
            if length < 0:
                self.close_connection = True
                return 400, {"error": f"Content-Length {raw_length[:40]!r} is not a byte count"}
            if length > max_message_bytes:
                self.close_connection = True  # the body is not read: the connection cannot be reused
                return 413, {"error": f"body of {length} bytes exceeds --max-message-bytes={max_message_bytes}"}
            busy = queue.admit(length)
            if busy:
                count_error()
                self.close_connection = True
                return 503, {"error": busy}
            try:
                try:
                    raw = self.rfile.read(length)
                except (TimeoutError, socket.timeout):
                    count_error()
                    self.close_connection = True
                    return 408, {"error": f"body not received within --http-timeout-s={http_timeout_s}"}
                if len(raw) < length:
                    self.close_connection = True
                    return 400, {"error": f"body ended after {len(raw)} of {length} bytes (Content-Length)"}
                return post(raw)
            finally:
                queue.release(length)

    return Handler


def start_http(http: str, handler: type, max_connections: int, name: str) -> tuple[BoundedHTTPServer, threading.Thread]:
    host, port = parse_http(http)
    server = BoundedHTTPServer((host, port), handler, max_connections)
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()
    return server, thread


def stop_http(server: BoundedHTTPServer | None, thread: threading.Thread | None) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()
    if thread is not None:
        thread.join(timeout=SHUTDOWN_GRACE_S)


def run_until_signal(serve: Callable[[asyncio.Event], Awaitable[Any]]) -> tuple[Any, str]:
    """``asyncio.run(serve(stop))`` where SIGTERM / SIGINT set ``stop``; returns its result and the
    name of the signal that stopped it ("request" when ``stop`` was set otherwise)."""
    reason: list[str] = []

    async def main() -> Any:
        stop = asyncio.Event()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(sig, lambda s=sig: (reason.append(s.name), stop.set()))
        return await serve(stop)

    result = asyncio.run(main())
    return result, reason[0] if reason else "request"
