"""Request/reply over ZeroMQ DEALER sockets with a deadline: the client half every StreamRFT service
client shares (remote rewards, remote environments).

Every request in flight owns one DEALER socket from a pool. A socket whose request timed out is closed
(``linger=0``) and replaced, so a late reply dies with it and can never be read as the answer to a
later request; a reply that is not the one awaited (``ours(data)`` is false) is discarded and counted
in ``n_discarded``. ZeroMQ reconnects a socket by itself, so a service restarted on the same address
is reached again by the next attempt without any action here.
"""

from __future__ import annotations

import asyncio
from typing import Callable

import zmq
import zmq.asyncio


class DealerPool:
    """``await request(payload, timeout_s, ours)`` -> the reply frame, or None when none came in time."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.n_discarded = 0
        self._ctx = zmq.asyncio.Context()
        self._idle: list[zmq.asyncio.Socket] = []
        self._closed = False

    def _take(self) -> zmq.asyncio.Socket:
        if self._idle:
            return self._idle.pop()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)  # close never blocks on unsent requests
        sock.connect(self.address)
        return sock

    async def request(self, payload: bytes, timeout_s: float, ours: Callable[[bytes], bool]) -> bytes | None:
        """Send ``payload`` and wait up to ``timeout_s`` for a reply ``ours`` accepts. Raises
        zmq.ZMQError when the socket breaks (or the pool is closed under the call)."""
        sock = self._take()
        keep = False
        try:
            await sock.send(payload)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await sock.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                    return None
                data = await sock.recv()
                if not ours(data):
                    self.n_discarded += 1  # an answer to some earlier request: not ours
                    continue
                keep = True
                return data
        finally:
            if keep and not self._closed:
                self._idle.append(sock)
            elif not sock.closed:  # timed out or broken: a late reply must die with this socket
                sock.close(linger=0)

    def close(self) -> None:
        """Close every socket and the context; idempotent. destroy, not term: term would wait forever
        for sockets of requests still in flight."""
        if self._closed:
            return
        self._closed = True
        for sock in self._idle:
            sock.close(linger=0)
        self._idle.clear()
        self._ctx.destroy(linger=0)
