"""Credit-based async channels over ZeroMQ: the inboxes of a rank's pipeline stages.

A :class:`ChannelReceiver` binds an address and owns a bounded inbox of ``capacity`` items; any number
of :class:`ChannelSender` s connect to it. The transport is chosen by the address alone
(``inproc://`` inside a process, ``ipc://`` across processes on a node, ``tcp://`` across hosts), so
moving a stage out of process is a change of address, not of code.

Backpressure (credits). The receiver holds ``capacity`` credits. A sender spends one credit per
message and, when it has none, waits until the receiver grants more; a credit returns to the
receiver's pool when the consumer takes an item out with :meth:`ChannelReceiver.recv`. So at every
moment ``items in the inbox + messages in flight + credits held by senders <= capacity``, and a full,
slow receiver stalls its senders instead of growing a queue.

Credits are one shared pool per receiver, handed out on demand: a sender asks (``hello`` on first
use, ``want`` whenever it is out of credits and a send is waiting), the receiver answers askers in
FIFO order with ``min(free credits, capacity // connected senders)`` each. A lone sender therefore
gets the whole capacity; several senders share it fairly; an idle sender never asks, so it holds at
most what it got at its last ask. A closing sender says ``bye`` so its unused credits return to the
pool; a sender that crashes without ``bye`` leaks its credits until the receiver is recreated.

Wire (DEALER sender -> ROUTER receiver, which prepends the sender's routing id):

    [b"hello"]                           first contact; also asks for credits
    [b"want"]                            out of credits, a send is waiting
    [b"data", header, *tensor_frames]    costs one credit; header = protocols.encode(Message)
    [b"batch", msgpack([k1, k2, ...]), header1, *tensor_frames1, header2, ...]
                                         n items of k_i frames each (header + tensors): n credits
    [b"bye"]                             closing; unused credits go back to the pool
    receiver -> sender: [b"grant", msgpack(n)]   n more credits (the first grant ends the handshake)

Coalescing. ``send`` spends its credit and queues the encoded item; the queue goes out as one ZeroMQ
message at the next turn of the event loop (or at once, before the sender waits for credits or closes).
A stage that sends many items in one turn (the generator when a decode block finishes 512 samples, the
advantage stage releasing a group) thus pays one socket send, one receive and one wake-up of the
receiver for all of them instead of one each (with the reward stage's batches: 0.77x the event loop's
time in the per-sample tail, benchmarks/tail_bench.py, NOTES.md v15). Order, credits (one per item) and the inbox's
items are unchanged: the receiver splits a batch into its items on arrival.

Tensors travel as raw frames beside the header, one per ``header.tensors`` TensorSpec (see
``streamrft.runtime.frames``). Nothing on the wire is pickled.

ZeroMQ details that matter here:
- Handshake order: a DEALER that ``connect()`` s gets its pipe at once and queues ``hello`` until the
  receiver binds (ZeroMQ reconnects for ipc/tcp), so bind and connect may happen in either order.
  A sender that hears no grant within ``connect_timeout`` raises ChannelTimeout naming the address.
- ``inproc://`` only works between sockets of one ``zmq.Context``: sender and receiver must share a
  context; both default to ``zmq.asyncio.Context.instance()``.
- High-water marks stay at ZeroMQ's default (1000 messages per pipe): the credits keep the queues far
  below it, and the receiver's pump task drains its socket continuously into the inbox.
- ``linger=0`` on every socket so closing never blocks a process or a context's ``term()``; the one
  exception is a sender's farewell ``bye`` (linger 50 ms, so the message is not dropped on close).
- ``ROUTER_MANDATORY`` makes a grant to a vanished sender an error (its credits are reclaimed)
  instead of a silent drop.
- Tensor frames go with ``copy=False``: pyzmq copies frames below its copy threshold (64 KiB) and
  hands larger ones to libzmq zero-copy, keeping a reference until they are sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import uuid
from collections import deque
from typing import Any

import msgspec
import torch
import zmq
import zmq.asyncio

import protocols
from streamrft.runtime.frames import frames_to_tensors, tensors_to_frames

log = logging.getLogger(__name__)

TRANSPORTS = ("inproc", "ipc", "tcp")

HELLO = b"hello"
WANT = b"want"
DATA = b"data"
BATCH = b"batch"
BYE = b"bye"
GRANT = b"grant"

_BYE_LINGER_MS = 50
_IPC_PATH_MAX = 100  # Unix socket paths are limited to ~107 bytes; keep a margin.


class ChannelError(RuntimeError):
    """Base of channel failures at run time."""


class ChannelTimeout(ChannelError, TimeoutError):
    """A send waited too long for a credit, or a recv for a message; the message says which."""


class ChannelClosed(ChannelError):
    """The channel was closed while (or before) an operation waited on it."""


class ChannelUsageError(ValueError):
    """A channel built or called with a bad value (address, capacity, header)."""


def _transport_of(address: str) -> str:
    transport, sep, rest = address.partition("://")
    if not sep or transport not in TRANSPORTS or not rest:
        raise ChannelUsageError(
            f"channel address {address!r} is not one of inproc://NAME, ipc:///PATH, tcp://HOST:PORT; "
            "build it with channel_address(transport, name, rank, run_id)"
        )
    return transport


def channel_address(transport: str, name: str, rank: int, run_id: str) -> str:
    """The default address of channel ``name`` on ``rank``: unique per run, bound on localhost.

    ``tcp`` returns ``tcp://127.0.0.1:0``: the port is chosen at bind; senders connect to
    ``receiver.address``.
    """
    if transport not in TRANSPORTS:
        raise ChannelUsageError(f"transport {transport!r} is unknown; use one of {list(TRANSPORTS)}")
    for field, value in (("name", name), ("run_id", run_id)):
        if not value or not all(c.isalnum() or c in "_.-" for c in value):
            raise ChannelUsageError(
                f"channel {field}={value!r} must be non-empty and use only letters, digits, '_', '.', '-'"
            )
    if not isinstance(rank, int) or rank < 0:
        raise ChannelUsageError(f"rank={rank!r} must be a non-negative int")
    stem = f"streamrft-{run_id}-{name}-{rank}"
    if transport == "inproc":
        return f"inproc://{stem}"
    if transport == "ipc":
        path = f"/tmp/{stem}.sock"
        if len(path) > _IPC_PATH_MAX:
            raise ChannelUsageError(
                f"ipc path {path!r} is {len(path)} bytes, over the Unix socket limit of {_IPC_PATH_MAX}; "
                "use a shorter run_id or channel name"
            )
        return f"ipc://{path}"
    return "tcp://127.0.0.1:0"


def _default_context(ctx: zmq.asyncio.Context | None) -> zmq.asyncio.Context:
    return ctx if ctx is not None else zmq.asyncio.Context.instance()


def _where(name: str, rank: int, address: str) -> str:
    return f"channel {name!r} rank {rank} ({address})"


class _MalformedBatch:
    """Stands for the frames of a batch message that could not be split (decoded at recv as an error)."""

    def __init__(self, reason: str):
        self.reason = reason


class ChannelReceiver:
    """Binds ``address`` and owns the inbox (``capacity`` items) and its credits.

    Build it inside a running event loop: a pump task then starts at once, answering handshakes and
    moving arriving messages into the inbox even before the first ``recv``. Built outside a loop,
    the pump starts at the first ``recv``.
    """

    def __init__(
        self,
        address: str,
        capacity: int,
        *,
        name: str,
        rank: int,
        message_type: Any,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ChannelUsageError(f"channel {name!r} capacity={capacity!r} must be an int >= 1 (the inbox size)")
        _transport_of(address)
        try:
            msgspec.msgpack.Decoder(message_type)
        except TypeError as exc:
            raise ChannelUsageError(
                f"channel {name!r} message_type={message_type!r} is not decodable ({exc}); "
                "pass a protocols.Message subclass or a Union of them"
            ) from None
        self.name = name
        self.rank = rank
        self.capacity = capacity
        self.message_type = message_type
        self._socket = _default_context(ctx).socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self._socket.bind(address)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            raise ChannelUsageError(
                f"{_where(name, rank, address)}: cannot bind: {exc}; is another receiver bound there? "
                "pick another address or run_id"
            ) from None
        # The real endpoint: for tcp://127.0.0.1:0 this carries the port the OS chose.
        self.address: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.peak_qsize = 0  # the most items the inbox ever held (backpressure diagnostics)
        self.uncredited_dropped = 0  # data messages from peers that held no credit (dropped)
        self._inbox: deque[list[zmq.Frame]] = deque()
        self._free = capacity
        self._granted: dict[bytes, int] = {}  # sender routing id -> credits granted, not yet used
        self._hungry: deque[bytes] = deque()  # senders waiting for a grant, FIFO
        self._waiters: deque[asyncio.Future] = deque()
        self._closed = False
        self._pump_task: asyncio.Task | None = None
        self._pump_error: BaseException | None = None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            self._start_pump()

    def __repr__(self) -> str:
        return f"ChannelReceiver({self.address!r}, capacity={self.capacity}, name={self.name!r}, rank={self.rank})"

    def qsize(self) -> int:
        """Items received and not yet taken by ``recv``."""
        return len(self._inbox)

    async def recv(self, timeout: float | None = None) -> tuple[protocols.Message, dict[str, torch.Tensor]]:
        """Take the oldest item: its header and its tensors (views of the received frames).

        Taking an item returns its credit, even when decoding it then fails: a malformed message
        raises ProtocolError (or ProtocolVersionError) here and the channel keeps working.
        """
        self._check_open("recv")
        self._start_pump()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._inbox:
            if self._pump_error is not None:
                error = self._pump_error
                raise ChannelError(f"{self._where()}: the receive pump failed: {error!r}") from error
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                await asyncio.wait_for(waiter, remaining)
            except asyncio.TimeoutError:
                raise ChannelTimeout(
                    f"{self._where()}: recv waited {timeout}s for a message and none arrived; "
                    "the upstream stage is slow or stopped (raise the timeout or check that stage)"
                ) from None
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        frames = self._inbox.popleft()
        self._free += 1
        self._grant_to_hungry()
        return self._decode(frames)

    def close(self) -> None:
        """Close the socket (linger=0); pending and later recv calls raise ChannelClosed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(ChannelClosed(f"{self._where()}: closed while recv was waiting"))
        if self._pump_task is not None and not self._pump_task.done():
            try:
                self._pump_task.cancel()
            except RuntimeError:  # its event loop is already closed: nothing left to cancel
                pass
        self._socket.close(linger=0)
        if self.address.startswith("ipc://"):
            # libzmq leaves the socket file behind; the receiver bound it, so it removes it.
            with contextlib.suppress(OSError):
                os.unlink(self.address[len("ipc://") :])

    # -- internals --------------------------------------------------------------------------

    def _where(self) -> str:
        return _where(self.name, self.rank, self.address)

    def _check_open(self, operation: str) -> None:
        if self._closed:
            raise ChannelClosed(f"{self._where()}: {operation} on a closed receiver")

    def _start_pump(self) -> None:
        if self._pump_task is None:
            self._pump_task = asyncio.get_running_loop().create_task(
                self._pump(), name=f"channel-pump-{self.name}-{self.rank}"
            )

    async def _pump(self) -> None:
        """Move every arriving message into the inbox or the credit book, as soon as it arrives."""
        try:
            while True:
                self._on_message(await self._socket.recv_multipart(copy=False))
                # Drain what is already queued without a trip through the event loop per message.
                for _ in range(self.capacity + 16):
                    ready = self._socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    if isinstance(ready.exception(), zmq.Again):
                        break
                    self._on_message(ready.result())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken socket: report it to every recv instead of hanging them
            if self._closed:
                return
            self._pump_error = exc
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)  # recv sees _pump_error and raises

    def _on_message(self, parts: list[zmq.Frame]) -> None:
        peer = parts[0].bytes
        kind = parts[1].bytes if len(parts) > 1 else b""
        if kind == DATA:
            self._accept(peer, [parts[2:]])
        elif kind == BATCH:
            self._accept(peer, self._split_batch(peer, parts[2:]))
        elif kind in (HELLO, WANT):
            self._granted.setdefault(peer, 0)
            if peer not in self._hungry:
                self._hungry.append(peer)
            self._grant_to_hungry()
        elif kind == BYE:
            # DEALER->ROUTER keeps order, so every data message of this peer has arrived already.
            self._free += self._granted.pop(peer, 0)
            if peer in self._hungry:
                self._hungry.remove(peer)
            self._grant_to_hungry()
        else:
            log.warning("%s: ignored a message of unknown kind %r from peer %r", self._where(), kind[:32], peer)

    def _accept(self, peer: bytes, items: list[list[zmq.Frame]]) -> None:
        """Items of one message into the inbox, one credit each; none if the peer holds too few credits."""
        if not items:
            return
        if self._granted.get(peer, 0) < len(items):
            self.uncredited_dropped += len(items)
            log.warning("%s: dropped %d data item(s) from peer %r that held %d credit(s) (%d dropped so far)",
                        self._where(), len(items), peer, self._granted.get(peer, 0), self.uncredited_dropped)
            return
        self._granted[peer] -= len(items)
        self._inbox.extend(items)
        self.peak_qsize = max(self.peak_qsize, len(self._inbox))
        assert len(self._inbox) <= self.capacity, "credit accounting let the inbox overflow"
        woken = 0
        while self._waiters and woken < len(items):
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                woken += 1

    def _split_batch(self, peer: bytes, parts: list[zmq.Frame]) -> list[list[zmq.Frame]]:
        """A batch's items, as lists of frames (header first). A batch whose frame counts do not describe its
        frames is one item that fails to decode at ``recv`` (a ProtocolError there, naming the channel), so a
        broken peer's message is neither lost silently nor able to stop the pump."""
        try:
            if not parts:
                raise ValueError("no frame-count frame")
            counts = msgspec.msgpack.decode(parts[0].bytes, type=list[int])
            if not counts or any(k < 1 for k in counts) or sum(counts) != len(parts) - 1:
                raise ValueError(f"frame counts {counts[:8]} for {len(parts) - 1} frame(s)")
        except (msgspec.DecodeError, ValueError) as exc:
            log.warning("%s: malformed batch from peer %r: %s", self._where(), peer, exc)
            return [[_MalformedBatch(str(exc))]]
        items, at = [], 1
        for k in counts:
            items.append(parts[at:at + k])
            at += k
        return items

    def _grant_to_hungry(self) -> None:
        share = max(1, self.capacity // max(1, len(self._granted)))
        while self._free > 0 and self._hungry:
            peer = self._hungry.popleft()
            credits = min(self._free, share)
            sent = self._socket.send_multipart([peer, GRANT, msgspec.msgpack.encode(credits)], flags=zmq.NOBLOCK)
            error = sent.exception() if sent.done() else None
            if error is not None:  # EHOSTUNREACH: the sender is gone; reclaim what it held
                log.warning("%s: sender %r is unreachable (%s); reclaiming its credits", self._where(), peer, error)
                self._free += self._granted.pop(peer, 0)
                continue
            self._free -= credits
            self._granted[peer] = self._granted.get(peer, 0) + credits

    def _decode(self, frames: list[zmq.Frame]) -> tuple[protocols.Message, dict[str, torch.Tensor]]:
        try:
            if not frames:
                raise protocols.ProtocolError("data message without a header frame")
            if isinstance(frames[0], _MalformedBatch):
                raise protocols.ProtocolError(f"malformed batch message: {frames[0].reason}")
            header = protocols.decode(frames[0].buffer, self.message_type)
            specs = getattr(header, "tensors", [])
            tensors = frames_to_tensors(specs, [frame.buffer for frame in frames[1:]])
        except protocols.ProtocolError as exc:
            raise type(exc)(f"{self._where()}: {exc}") from None
        except Exception as exc:  # decoders raise only ProtocolError; should one not, the caller still gets one
            raise protocols.ProtocolError(f"{self._where()}: undecodable message: {type(exc).__name__}: {exc}") from None
        return header, tensors


class ChannelSender:
    """Connects to a receiver's address and sends headers plus tensors, one credit per message.

    Concurrent ``send`` calls on one sender are served in call order (an asyncio.Lock is FIFO), so a
    receiver sees one sender's messages in the order they were sent.
    """

    coalesce = True  # False: each item goes out at once in a message of its own (benchmarks/tail_bench.py's baseline)

    def __init__(
        self,
        address: str,
        *,
        name: str,
        rank: int,
        ctx: zmq.asyncio.Context | None = None,
        connect_timeout: float = 30.0,
    ) -> None:
        transport = _transport_of(address)
        if transport == "tcp" and address.rsplit(":", 1)[-1] in ("0", "*"):
            raise ChannelUsageError(
                f"channel {name!r} rank {rank}: sender address {address!r} has no port; "
                "connect to the receiver's bound endpoint, receiver.address"
            )
        if not connect_timeout > 0:
            raise ChannelUsageError(f"channel {name!r} connect_timeout={connect_timeout!r} must be > 0 seconds")
        self.name = name
        self.rank = rank
        self.address = address
        self.connect_timeout = connect_timeout
        self.credits = 0  # credits currently available to this sender
        self._socket = _default_context(ctx).socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # A fixed routing id keeps the receiver's credit book stable across ipc/tcp reconnects.
        self._socket.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
        self._socket.connect(address)
        self._hello_sent = False
        self._connected = False  # the first grant arrived
        self._want_pending = False  # asked for credits, no grant yet
        self._handshake_deadline = math.inf
        self._lock = asyncio.Lock()
        self._closed = False
        self._closed_signal: asyncio.Future | None = None
        self._queued: list[tuple[bytes, list]] = []  # credited items not yet handed to the socket (coalescing)
        self._flush_scheduled = False
        self._send_error: BaseException | None = None  # a failed socket send, raised by the next send
        self.messages_sent = 0  # ZeroMQ data/batch messages (items per message = items sent / this)

    def __repr__(self) -> str:
        return f"ChannelSender({self.address!r}, name={self.name!r}, rank={self.rank}, credits={self.credits})"

    async def send(
        self,
        header: protocols.Message,
        tensors: dict[str, torch.Tensor] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Wait for a credit (at most ``timeout`` seconds), then queue ``header`` and ``tensors``: they go
        out with every other item queued in this turn of the event loop, as one message (module docstring).

        ``header.tensors`` is filled here from ``tensors``. Do not modify a sent tensor in place: its
        bytes go out zero-copy and, over inproc, the receiver may view the same memory.
        """
        self._check_open("send")
        if not isinstance(header, protocols.Message):
            raise ChannelUsageError(
                f"{self._where()}: header is a {type(header).__name__}, expected a protocols.Message"
            )
        specs, buffers = tensors_to_frames(tensors)
        if "tensors" in header.__struct_fields__:
            header = msgspec.structs.replace(header, tensors=specs)
        elif specs:
            raise ChannelUsageError(
                f"{self._where()}: {type(header).__name__} has no `tensors` field, so tensors "
                f"{[s.name for s in specs]} cannot travel with it; use a pipeline message or send no tensors"
            )
        await self._send_frames(protocols.encode(header), buffers, timeout)

    def close(self) -> None:
        """Say bye (unused credits return to the receiver), close the socket; pending sends raise
        ChannelClosed. Idempotent."""
        if self._closed:
            return
        self._flush(blocking_api=True)  # credited items still queued go out before the bye
        self._closed = True
        if self._closed_signal is not None and not self._closed_signal.done():
            try:
                self._closed_signal.set_result(None)
            except RuntimeError:  # its event loop is already closed: nobody is waiting
                pass
        linger = 0
        if self._hello_sent:
            try:  # the plain (blocking-API) send: no event loop needed, and the socket closes next
                zmq.Socket.send(self._socket, BYE, zmq.NOBLOCK)
                linger = _BYE_LINGER_MS
            except zmq.ZMQError:
                pass  # queue full or peer gone: the receiver reclaims on EHOSTUNREACH at the latest
        self._socket.close(linger=linger)

    # -- internals --------------------------------------------------------------------------

    def _where(self) -> str:
        return _where(self.name, self.rank, self.address)

    def _check_open(self, operation: str) -> None:
        if self._closed:
            raise ChannelClosed(f"{self._where()}: {operation} on a closed sender")

    async def _send_frames(self, header_bytes: bytes, buffers: list, timeout: float | None) -> None:
        """Send one data message under one credit (also the seam tests use to send crafted bytes)."""
        loop = asyncio.get_running_loop()
        if self._closed_signal is None:
            self._closed_signal = loop.create_future()
        deadline = math.inf if timeout is None else loop.time() + timeout
        try:
            if self._lock.locked():  # another send of this sender is waiting for a credit
                remaining = None if timeout is None else max(0.0, deadline - loop.time())
                await asyncio.wait_for(self._lock.acquire(), remaining)
            else:
                await self._lock.acquire()  # free: no wait_for task to pay for
        except asyncio.TimeoutError:
            raise ChannelTimeout(
                f"{self._where()}: send waited {timeout}s for a credit behind earlier sends on this sender; "
                "the receiver's inbox is full or its consumer is slow (raise the timeout or the capacity)"
            ) from None
        try:
            self._check_open("send")
            self._raise_send_error()
            if self.credits == 0:
                self._flush()  # what is queued goes first: the receiver returns credits only for what it got
                while self.credits == 0:
                    await self._await_credit(deadline, timeout)
            self.credits -= 1
            self._queued.append((header_bytes, buffers))
            if not self.coalesce:
                self._flush()
            elif not self._flush_scheduled:
                self._flush_scheduled = True
                loop.call_soon(self._flush)
        finally:
            self._lock.release()

    def _flush(self, blocking_api: bool = False) -> None:
        """Hand the queued items to the socket: one data message, or one batch message for several.
        ``blocking_api``: through the plain socket API (no event loop needed: ``close``)."""
        self._flush_scheduled = False
        if not self._queued or self._closed:
            return
        items, self._queued = self._queued, []
        if len(items) == 1:
            header_bytes, buffers = items[0]
            frames = [DATA, header_bytes, *buffers]
        else:
            frames = [BATCH, msgspec.msgpack.encode([1 + len(buffers) for _, buffers in items])]
            for header_bytes, buffers in items:
                frames += [header_bytes, *buffers]
        self.messages_sent += 1
        if blocking_api:
            try:
                zmq.Socket.send_multipart(self._socket, frames, zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as exc:
                log.warning("%s: %d item(s) queued at close could not be sent: %s", self._where(), len(items), exc)
            return
        sent = self._socket.send_multipart(frames, copy=False)
        if sent.done():
            self._note_send_result(sent)
        else:  # the pipe is full (credits keep it far below the high-water mark): it completes later
            sent.add_done_callback(self._note_send_result)

    def _note_send_result(self, sent: asyncio.Future) -> None:
        if not sent.cancelled() and sent.exception() is not None and self._send_error is None:
            self._send_error = sent.exception()

    def _raise_send_error(self) -> None:
        if self._send_error is not None:
            error = self._send_error
            raise ChannelError(f"{self._where()}: an earlier send failed on the socket: {error!r}") from error

    async def _await_credit(self, deadline: float, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        if not self._hello_sent:
            self._hello_sent = self._want_pending = True
            self._handshake_deadline = loop.time() + self.connect_timeout
            await self._until(self._socket.send_multipart([HELLO]), deadline)
        elif not self._want_pending:
            self._want_pending = True
            await self._until(self._socket.send_multipart([WANT]), deadline)
        wait_until = deadline if self._connected else min(deadline, self._handshake_deadline)
        parts = await self._until(self._socket.recv_multipart(), wait_until)
        if parts is None:
            if not self._connected and self._handshake_deadline <= deadline:
                raise ChannelTimeout(
                    f"{self._where()}: no receiver answered the hello (no credit granted) within "
                    f"connect_timeout={self.connect_timeout}s; start the receiver or fix the address "
                    "(inproc: sender and receiver must share one zmq.asyncio.Context)"
                )
            raise ChannelTimeout(
                f"{self._where()}: send waited {timeout}s for a credit; the receiver's inbox is full "
                "or its consumer is slow (raise the timeout or the capacity)"
            )
        if len(parts) == 2 and parts[0] == GRANT:
            self.credits += msgspec.msgpack.decode(parts[1], type=int)
            self._connected = True
            self._want_pending = False
        else:
            log.warning("%s: ignored an unknown message from the receiver: %r", self._where(), parts[:1])

    async def _until(self, future: asyncio.Future, deadline: float) -> Any:
        """The future's result; None if ``deadline`` (loop time) passes first; ChannelClosed if closed."""
        if future.done() and not self._closed:  # the common case for a send: no wait at all
            return future.result()
        loop = asyncio.get_running_loop()
        remaining = None if deadline == math.inf else max(0.0, deadline - loop.time())
        try:
            done, _ = await asyncio.wait(
                {future, self._closed_signal}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
            if self._closed:
                raise ChannelClosed(f"{self._where()}: closed while send was waiting")
            return future.result() if future in done else None
        finally:
            if not future.done():
                future.cancel()
