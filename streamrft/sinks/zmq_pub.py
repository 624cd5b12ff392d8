"""ZeroMQ trajectory stream: each rank publishes msgpack TrajectoryRecord frames on a socket.

Slow joiners. PUB/SUB drops every message sent before a subscriber's subscription has reached the
publisher (the TCP connect and the subscription message take a few milliseconds), and a PUB with no
subscriber drops everything. So:

- The sink binds an XPUB socket (a PUB that also delivers subscription messages), and
  :meth:`ZmqPubSink.wait_for_subscribers` blocks until ``n`` subscriptions arrived: the READY
  handshake for a consumer that must see the first record (tests, a recorder started with the run).
- :class:`TrajectorySubscriber` connects and subscribes at once; start it before the run, or accept
  that records published before it joined are lost. It is a live view, not a log: use the JSONL or
  Parquet sinks for a complete record.
- The send high-water mark (``hwm``) bounds memory when a subscriber is slow; beyond it records are
  dropped for that subscriber (``NOBLOCK`` send: the training step never waits for a consumer).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import zmq

from protocols import TrajectoryRecord, decode, encode


def rank_address(address: str, rank: int) -> str:
    """The address rank ``rank`` binds: ``tcp://host:P`` -> ``tcp://host:(P + rank)``; other
    transports get ``-rank<r>`` appended (``ipc:///tmp/traj`` -> ``ipc:///tmp/traj-rank1``)."""
    match = re.fullmatch(r"(tcp://.+):(\d+)", address)
    if match:
        return f"{match.group(1)}:{int(match.group(2)) + rank}"
    if address.startswith("tcp://"):
        raise ValueError(f"sinks.zmq_pub={address!r} needs an explicit port, e.g. tcp://127.0.0.1:5600")
    return f"{address}-rank{rank}"


class ZmqPubSink:
    """Publishes each record as one frame (``protocols.encode``) on an XPUB socket bound at ``address``."""

    def __init__(self, address: str, hwm: int = 10000, context: zmq.Context | None = None):
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        self._socket.setsockopt(zmq.LINGER, 0)  # never block shutdown on an absent subscriber
        # Deliver every (un)subscription, not only the first per topic, so subscribers can be counted.
        self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._socket.setsockopt(zmq.XPUB_VERBOSER, 1)
        self._socket.bind(address)
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)  # resolves tcp port 0 / "*"
        self.subscribers = 0
        self.dropped = 0  # records not sent because a subscriber's queue was full

    def wait_for_subscribers(self, n: int = 1, timeout: float = 10.0) -> bool:
        """Block until ``n`` subscriptions have arrived (READY handshake); False on timeout."""
        deadline = time.monotonic() + timeout
        while self.subscribers < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._socket.poll(int(remaining * 1000), zmq.POLLIN):
                return False
            self._drain_subscriptions()
        return True

    def _drain_subscriptions(self) -> None:
        while self._socket.poll(0, zmq.POLLIN):
            message = self._socket.recv()
            if message[:1] == b"\x01":
                self.subscribers += 1
            elif message[:1] == b"\x00":
                self.subscribers = max(0, self.subscribers - 1)

    def write(self, record: TrajectoryRecord) -> None:
        self._drain_subscriptions()
        try:
            self._socket.send(encode(record), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.dropped += 1

    def flush(self) -> None:
        """Nothing to flush: frames leave as they are written."""

    def close(self) -> None:
        self._socket.close(linger=0)


class TrajectorySubscriber:
    """SUB socket that receives every record published at ``address`` after it joined."""

    def __init__(self, address: str, context: zmq.Context | None = None):
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(address)

    def recv(self, timeout: float) -> TrajectoryRecord | None:
        """The next record, or None when none arrives within ``timeout`` seconds."""
        if not self._socket.poll(int(timeout * 1000), zmq.POLLIN):
            return None
        return decode(self._socket.recv(copy=False).buffer, TrajectoryRecord)

    def close(self) -> None:
        self._socket.close(linger=0)

    def __enter__(self) -> TrajectorySubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def subscribe_trajectories(address: str, timeout: float) -> Iterator[TrajectoryRecord]:
    """Yield records published at ``address`` until none arrives for ``timeout`` seconds."""
    with TrajectorySubscriber(address) as subscriber:
        while (record := subscriber.recv(timeout)) is not None:
            yield record
