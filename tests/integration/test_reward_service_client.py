"""RemoteRewardClient against a scripted in-process ZeroMQ ROUTER: late replies, wrong counts, malformed
replies, version mismatches and bounded concurrency, each checked on real sockets."""

from __future__ import annotations

import asyncio
import heapq
import threading
import time
from typing import Callable

import msgspec
import pytest
import zmq

from protocols import RewardItem, RewardReply, RewardRequest, decode, encode
from streamrft.rewards.remote import RemoteRewardClient
from tests.ports import free_port

pytestmark = pytest.mark.slow

# behaviour(request, nth_attempt_of_this_id) -> [(delay_s, reply frame bytes), ...]
Behaviour = Callable[[RewardRequest, int], list[tuple[float, bytes]]]


class ScriptedRouter:
    """A ROUTER in a thread that answers each request as ``behaviour`` says, and records what it saw."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.attempts: dict[str, int] = {}
        self.outstanding = 0  # requests received whose first reply is not sent yet
        self.max_outstanding = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scripted-router", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        queue: list[tuple[float, int, list[bytes], bytes, bool]] = []
        seq = 0
        while not self._stop.is_set():
            timeout = 20 if not queue else max(0, int((queue[0][0] - time.monotonic()) * 1000))
            if self.sock.poll(min(timeout, 20)):
                *envelope, payload = self.sock.recv_multipart()
                request = decode(payload, RewardRequest)
                n = self.attempts.get(request.request_id, 0)
                self.attempts[request.request_id] = n + 1
                self.outstanding += 1
                self.max_outstanding = max(self.max_outstanding, self.outstanding)
                for k, (delay, frame) in enumerate(self.behaviour(request, n)):
                    heapq.heappush(queue, (time.monotonic() + delay, seq, envelope, frame, k == 0))
                    seq += 1
            while queue and queue[0][0] <= time.monotonic():
                _, _, envelope, frame, first = heapq.heappop(queue)
                if first:
                    self.outstanding -= 1
                self.sock.send_multipart([*envelope, frame])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        assert not self._thread.is_alive(), "scripted router thread did not stop"
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def router_factory():
    routers: list[ScriptedRouter] = []

    def make(behaviour: Behaviour) -> ScriptedRouter:
        routers.append(ScriptedRouter(behaviour))
        return routers[-1]

    yield make
    for r in routers:
        r.close()


def items(n: int) -> list[RewardItem]:
    return [RewardItem(sample_id=f"s{i}", prompt="p", response=str(i), reference=str(i)) for i in range(n)]


def ones(request: RewardRequest, value: float = 1.0) -> bytes:
    return encode(RewardReply(request_id=request.request_id, rewards=[value] * len(request.items)))


def run_client(address: str, fn, **kwargs):
    async def go():
        client = RemoteRewardClient(address, **kwargs)
        try:
            return await fn(client), client
        finally:
            await client.close()

    return asyncio.run(go())


def test_a_reply_after_its_timeout_is_discarded_not_given_to_the_next_request(router_factory):
    # Request 1, attempt 1: answered with 99s after 0.6 s (past its 0.4 s timeout); its retry (same id)
    # gets 1s at once. Request 2 is in flight (answered after 0.3 s) when the late 99s arrive.
    first_id: list[str] = []

    def behaviour(req, n):
        first_id.append(req.request_id) if not first_id else None
        if req.request_id == first_id[0]:
            return [(0.6, ones(req, 99.0))] if n == 0 else [(0.0, ones(req))]
        return [(0.3, ones(req, 2.0))]

    router = router_factory(behaviour)

    async def go(client):
        first = await client.score(items(2))
        second = await client.score(items(3))
        await asyncio.sleep(0.1)
        return first, second

    (first, second), client = run_client(router.address, go, timeout_s=0.4, retries=2)
    assert first == [1.0, 1.0] and second == [2.0, 2.0, 2.0]
    assert client.n_timeouts == 1 and client.n_retries == 1 and client.n_failed == 0
    assert router.attempts[first_id[0]] == 2  # retried with the same id


def test_a_reply_with_another_request_id_is_discarded(router_factory):
    def behaviour(req, n):
        stray = encode(RewardReply(request_id="someone-else", rewards=[5.0] * len(req.items)))
        return [(0.0, stray), (0.05, ones(req))]

    router = router_factory(behaviour)
    out, client = run_client(router.address, lambda c: c.score(items(2)), timeout_s=2.0)
    assert out == [1.0, 1.0] and client.n_discarded == 1


def test_a_reply_with_the_wrong_number_of_rewards_fails_those_items(router_factory):
    router = router_factory(lambda req, n: [(0.0, encode(RewardReply(request_id=req.request_id, rewards=[1.0])))])
    out, client = run_client(router.address, lambda c: c.score(items(3)), timeout_s=2.0)
    assert all(isinstance(v, Exception) and "1 rewards for 3 samples" in str(v) for v in out)
    assert client.n_failed == 1 and client.n_retries == 0


def test_a_malformed_reply_fails_those_items_without_retrying(router_factory):
    router = router_factory(lambda req, n: [(0.0, b"\xc1 not msgpack")])
    out, client = run_client(router.address, lambda c: c.score(items(2)), timeout_s=2.0)
    assert all("malformed reply" in str(v) for v in out)
    assert client.n_retries == 0 and client.n_failed == 1


def test_a_reply_in_another_protocol_version_names_both_versions(router_factory):
    class FutureReply(msgspec.Struct, tag="RewardReply", tag_field="kind"):
        request_id: str
        rewards: list[float]
        protocol_version: int = 99

    router = router_factory(lambda req, n: [(0.0, msgspec.msgpack.encode(FutureReply(req.request_id, [1.0])))])
    out, client = run_client(router.address, lambda c: c.score(items(1)), timeout_s=2.0)
    assert "version 99" in str(out[0]) and "version 1" in str(out[0])
    assert client.n_failed == 1


def test_an_error_reply_fails_the_items_with_the_service_message(router_factory):
    router = router_factory(lambda req, n: [(0.0, encode(RewardReply(request_id=req.request_id, error="fn broke")))])
    out, _ = run_client(router.address, lambda c: c.score(items(2)), timeout_s=2.0)
    assert all("fn broke" in str(v) for v in out)


def test_nan_from_the_service_fails_that_item_only(router_factory):
    reply = lambda req: encode(RewardReply(request_id=req.request_id, rewards=[1.0, float("nan")]))  # noqa: E731
    router = router_factory(lambda req, n: [(0.0, reply(req))])
    out, _ = run_client(router.address, lambda c: c.score(items(2)), timeout_s=2.0)
    assert out[0] == 1.0 and "'s1'" in str(out[1])


def test_requests_in_flight_never_exceed_max_concurrency(router_factory):
    router = router_factory(lambda req, n: [(0.1, ones(req))])

    async def go(client):
        return await asyncio.gather(*(client.score(items(2)) for _ in range(7)))

    out, client = run_client(router.address, go, timeout_s=5.0, max_concurrency=2)
    assert all(o == [1.0, 1.0] for o in out)
    assert router.max_outstanding == 2 and client.peak_in_flight == 2
    assert client.n_requests == 7 and client.in_flight == 0


def test_an_unreachable_service_fails_after_the_retries_and_counts_them():
    async def go(client):
        return await client.score(items(1))

    start = time.monotonic()
    out, client = run_client("tcp://127.0.0.1:9", go, timeout_s=0.1, retries=2)
    assert time.monotonic() - start < 3
    assert "after 3 attempts" in str(out[0])
    assert (client.n_timeouts, client.n_retries, client.n_failed) == (3, 2, 1)


def test_an_unreachable_http_service_fails_after_the_retries():
    port = free_port()  # nothing listens there
    out, client = run_client(f"http://127.0.0.1:{port}/", lambda c: c.score(items(2)), timeout_s=1.0, retries=1)
    assert all("after 2 attempts" in str(v) and "cannot reach" in str(v) for v in out)
    assert (client.n_retries, client.n_failed) == (1, 1)
