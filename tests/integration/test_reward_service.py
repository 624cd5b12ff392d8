"""A real `serve-reward` subprocess scored by RemoteRewardClient: ZeroMQ and HTTP modes, idempotent
retries, SIGKILL + restart on the same port, bad frames, version mismatch, clean SIGTERM shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import msgspec
import pytest
import zmq

from protocols import RewardItem, RewardReply, RewardRequest, decode, encode
from streamrft.rewards.remote import RemoteRewardClient
from tests.integration._services import ServiceProcess, services_fixture
from tests.ports import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

SLOW_FUNCS = textwrap.dedent(
    """
    import time
    import streamrft.rewards

    @streamrft.rewards.batched
    def slow_value(responses, references):
        time.sleep(SLEEP)
        return [float(r) for r in responses]

    @streamrft.rewards.batched
    def one_short(responses, references):
        return [1.0] * (len(responses) - 1)
    """
)


class Service(ServiceProcess):
    """One serve-reward subprocess (``python -m streamrft.rewards.service``), running and ready; with
    ``--log-requests`` its log names each request it scored."""

    def __init__(self, *args: str) -> None:
        super().__init__("serve-reward", ["streamrft.rewards.service", *args], stop_timeout_s=15)

    def scored_ids(self) -> list[str]:
        return [m.group(1) for line in self.lines if (m := re.search(r"scoring request (\S+)", line))]

    def scored_ids_once(self, expected: list[str], timeout_s: float = 20.0) -> list[str]:
        """``scored_ids()`` once the reader thread has caught up with ``expected`` (a reply can arrive before
        its log line is read from the pipe), or as it is at the deadline."""
        deadline = time.monotonic() + timeout_s
        while self.scored_ids() != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.scored_ids()


services = services_fixture(Service)


@pytest.fixture
def slow_funcs(tmp_path):
    def write(sleep_s: float) -> str:
        path = tmp_path / f"slow_{str(sleep_s).replace('.', '_')}.py"
        path.write_text(SLOW_FUNCS.replace("SLEEP", str(sleep_s)))
        return str(path)

    return write


def items(values: list[int], reference: str = "3") -> list[RewardItem]:
    return [RewardItem(sample_id=f"s{v}", prompt="2+1=", response=str(v), reference=reference) for v in values]


def run_client(address: str, fn, **kwargs):
    async def go():
        client = RemoteRewardClient(address, **kwargs)
        try:
            return await fn(client), client
        finally:
            await client.close()

    return asyncio.run(go())


def test_the_arith_service_scores_batches_over_zeromq(services):
    svc = services("--fn", "arith", "--bind", f"tcp://127.0.0.1:{free_port()}", "--workers", "2")

    async def go(client):
        return await asyncio.gather(client.score(items([3, 4])), client.score(items([-3, 3], reference="-3")))

    out, client = run_client(svc.address("tcp"), go, timeout_s=5.0)
    assert out == [[1.0, 0.0], [1.0, 0.0]]
    assert client.n_failed == 0
    # A rule function needs no torch: the service starts in a fraction of a second. (It used to load torch and
    # transformers, ~5 s on CI, through streamrft.models's package imports, for a hub-id check.)
    assert "libtorch" not in Path(f"/proc/{svc.proc.pid}/maps").read_text()
    assert svc.stop() == 0
    assert any("stopped on SIGTERM" in line and "2 scored" in line for line in svc.lines), svc.lines


def test_the_http_mode_scores_queries_and_the_client_uses_it(services):
    svc = services("--fn", "arith", "--http", f"127.0.0.1:{free_port()}")
    url = svc.address("http")
    body = json.dumps({"queries": ["2+1=3", "2+1=5"], "prompts": ["2+1=", "2+1="], "references": ["3", "3"]})
    with urllib.request.urlopen(urllib.request.Request(url, data=body.encode()), timeout=10) as resp:
        assert json.loads(resp.read()) == {"rewards": [1.0, 0.0]}
    # The prompt "2+1=" holds digits: the service must cut it off, or arith would read 2.
    out, client = run_client(url, lambda c: c.score(items([3, 4])), timeout_s=5.0)
    assert out == [1.0, 0.0] and client.n_failed == 0


def test_the_http_mode_answers_a_bad_body_with_400_naming_the_field(services):
    svc = services("--fn", "arith", "--http", "127.0.0.1:0")
    req = urllib.request.Request(svc.address("http"), data=json.dumps({"queries": ["1"], "references": []}).encode())
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 400 and '\\"references\\" must be a list of 1 strings' in info.value.read().decode()
    info.value.close()


def test_a_retried_request_id_is_scored_once_within_one_service_lifetime(services, slow_funcs):
    svc = services("--fn", f"{slow_funcs(0.8)}:slow_value", "--workers", "2", "--log-requests")
    out, client = run_client(svc.address("tcp"), lambda c: c.score(items([5, 6])), timeout_s=0.35, retries=5)
    assert out == [5.0, 6.0]
    assert client.n_retries >= 2  # the retries arrived while the first copy was being scored
    svc.stop()
    assert len(svc.scored_ids()) == 1, svc.lines
    summary = next(line for line in svc.lines if "stopped on" in line)
    assert int(re.search(r"(\d+) from cache", summary).group(1)) >= 2


def test_a_killed_and_restarted_service_leaves_every_item_scored_exactly_once(services, slow_funcs):
    port = free_port()
    fn = f"{slow_funcs(0.15)}:slow_value"
    first = services("--fn", fn, "--bind", f"tcp://127.0.0.1:{port}", "--workers", "2", "--log-requests")
    batches = [list(range(10 * b, 10 * b + 4)) for b in range(12)]

    async def go(client):
        tasks = [asyncio.create_task(client.score(items(b))) for b in batches]
        await asyncio.sleep(0.4)
        first.stop(signal.SIGKILL)
        await asyncio.sleep(0.3)
        second = await asyncio.to_thread(
            services, "--fn", fn, "--bind", f"tcp://127.0.0.1:{port}", "--workers", "2", "--log-requests"
        )
        return await asyncio.gather(*tasks), second

    # retries outlast the restart: a new service process imports torch, ~10-20 s on a loaded 2-core machine
    (results, second), client = run_client(f"tcp://127.0.0.1:{port}", go, timeout_s=1.0, retries=60, max_concurrency=4)
    assert results == [[float(v) for v in b] for b in batches]  # one result per item, its own value
    assert client.n_failed == 0 and client.n_timeouts >= 1 and client.n_retries >= 1
    for svc in (first, second):  # no lifetime scored an id twice (a restart may re-score: at-least-once)
        counts = Counter(svc.scored_ids())
        assert counts and max(counts.values()) == 1, svc.lines
    assert second.stop() == 0


def test_a_batched_function_returning_too_few_rewards_fails_those_items(services, slow_funcs):
    svc = services("--fn", f"{slow_funcs(0)}:one_short")
    out, client = run_client(svc.address("tcp"), lambda c: c.score(items([1, 2, 3])), timeout_s=5.0)
    assert all("returned 2 values for 3 samples" in str(v) for v in out), out
    assert client.n_failed == 1


def raw_roundtrip(address: str, frame: bytes) -> RewardReply:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(frame)
        assert sock.poll(10_000), "no reply within 10 s"
        return decode(sock.recv(), RewardReply)
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_request_in_another_protocol_version_gets_an_error_reply_and_the_service_lives_on(services):
    svc = services("--fn", "arith")

    class OldRequest(msgspec.Struct, tag="RewardRequest", tag_field="kind"):
        request_id: str
        items: list
        protocol_version: int = 0

    reply = raw_roundtrip(svc.address("tcp"), msgspec.msgpack.encode(OldRequest("r-old", [])))
    assert reply.request_id == "r-old" and "version 0" in reply.error and "version 1" in reply.error
    good = raw_roundtrip(svc.address("tcp"), encode(RewardRequest(request_id="r-ok", items=items([3]))))
    assert good.rewards == [1.0] and not good.error


def test_a_malformed_frame_gets_an_error_reply_naming_the_problem(services):
    svc = services("--fn", "arith")
    reply = raw_roundtrip(svc.address("tcp"), b"\xc1garbage")
    assert "malformed frame" in reply.error
    assert svc.proc.poll() is None


def test_a_bad_function_spec_exits_with_status_2_and_a_message():
    proc = subprocess.run(
        [sys.executable, "-m", "streamrft.rewards.service", "--fn", "no_such_rule"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 2 and "'no_such_rule' is neither a rule" in proc.stderr


def test_sigint_stops_the_service_cleanly(services):
    svc = services("--fn", "gsm8k")
    time.sleep(0.1)
    assert svc.stop(signal.SIGINT) == 0
    assert any("stopped on SIGINT" in line for line in svc.lines)


# --- issue 16 item 7: a bounded service ----------------------------------------------------------------

HANG_FUNCS = textwrap.dedent(
    """
    import time

    def hang_on_request(response, reference):
        if response == "hang":
            time.sleep(3600)  # a reward function that never returns (a deadlock, a stuck sandbox)
        return 1.0

    def slow(response, reference):
        time.sleep(1.0)
        return 1.0
    """
)


@pytest.fixture
def hang_funcs(tmp_path) -> str:
    path = tmp_path / "hang_funcs.py"
    path.write_text(HANG_FUNCS)
    return str(path)


def http_raw(address: str, data: bytes, read_timeout: float = 10.0) -> tuple[int, dict]:
    """Send raw bytes to the HTTP port; the status code and JSON body of the reply (0, {} when none)."""
    host, port = address.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout) as conn:
        conn.sendall(data)
        chunks = []
        while True:
            try:
                chunk = conn.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        return 0, {}
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"application/json" in head, raw[:300]
    return status, json.loads(body)


def post(body: bytes, path: str = "/", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def dealer(address: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return ctx, sock


def test_item7_http_health_route_and_json_errors_for_unknown_paths_and_methods(services):
    svc = services("--fn", "arith", "--http", "127.0.0.1:0")
    url = svc.address("http")
    status, body = http_raw(url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200 and body["status"] == "ok" and body["fn"] == "arith" and body["queued"] == 0
    status, body = http_raw(url, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 404 and body["error"].startswith("no route GET /;")
    status, body = http_raw(url, b"GET /nope?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 404 and "GET /nope?x=1" in body["error"]
    status, body = http_raw(url, b"DELETE / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 501 and "DELETE" in body["error"]
    status, body = http_raw(url, b"this is not http\r\n\r\n")
    assert status == 400 and body["error"]


@pytest.mark.parametrize("header, status, expected", [
    ("Content-Length: -1\r\n", 400, "Content-Length '-1' is not a byte count"),
    ("Content-Length: ten\r\n", 400, "Content-Length 'ten' is not a byte count"),
    ("", 411, "Content-Length is required"),
    ("Content-Length: 1000000000000\r\n", 413, "body of 1000000000000 bytes exceeds --max-message-bytes=16777216"),
])
def test_item7_http_content_length_negative_missing_or_huge_gets_a_4xx_json_reply(services, header, status, expected):
    svc = services("--fn", "arith", "--http", "127.0.0.1:0")
    got = http_raw(svc.address("http"), f"POST / HTTP/1.1\r\nHost: x\r\n{header}\r\n".encode(), read_timeout=10)
    assert got == (status, {"error": expected})
    good = http_raw(svc.address("http"), post(b'{"queries": ["3"], "references": ["3"]}'))
    assert good == (200, {"rewards": [1.0]})


def test_item7_http_deeply_nested_json_and_missing_references_get_400_json(services):
    svc = services("--fn", "arith", "--http", "127.0.0.1:0")
    url = svc.address("http")
    status, body = http_raw(url, post(b"[" * 100_000 + b"]" * 100_000))
    assert status == 400 and "nested too deeply" in body["error"]
    status, body = http_raw(url, post(b'{"queries": ["2+1=3"], "prompts": ["2+1="]}'))
    assert status == 400 and body["error"] == 'arith compares with a reference: the body needs "references", one per query'
    status, body = http_raw(url, post(b'{"queries": ["3", "4"], "references": ["3", ""]}'))
    assert status == 400 and body["error"] == 'arith compares with a reference: "references"[1] is empty'


def test_item7_a_function_without_references_still_scores_bodies_without_them(services):
    svc = services("--fn", "boxed_format", "--http", "127.0.0.1:0")
    assert http_raw(svc.address("http"), post(b'{"queries": ["\\\\boxed{1}", "no"]}')) == (200, {"rewards": [1.0, 0.0]})


def test_item7_http_clients_that_never_send_their_body_are_timed_out_and_capped(services):
    svc = services("--fn", "arith", "--http", "127.0.0.1:0", "--http-timeout-s", "1", "--max-queued", "4")
    host, port = svc.address("http").removeprefix("http://").split(":")
    stalled = []
    for _ in range(8):  # headers promise 100 bytes, 10 arrive, then nothing
        conn = socket.create_connection((host, int(port)), timeout=10)
        conn.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
        stalled.append(conn)
        time.sleep(0.05)
    started = time.monotonic()
    replies = []
    for conn in stalled:
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        conn.close()
        replies.append(int(data.split(b" ", 2)[1]))
    # 4 connections were served and timed out reading the body (408); the 4 past --max-queued got 503 at once.
    assert sorted(replies) == [408] * 4 + [503] * 4, replies
    assert time.monotonic() - started < 5
    assert http_raw(svc.address("http"), post(b'{"queries": ["3"], "references": ["3"]}')) == (200, {"rewards": [1.0]})


def test_item7_a_zeromq_request_over_the_size_or_item_limit_gets_an_error_reply(services):
    svc = services("--fn", "arith", "--max-message-bytes", "5000", "--max-items", "10")
    big = encode(RewardRequest(request_id="big", items=items([3] * 40, reference="3" * 200)))
    assert len(big) > 5000
    reply = raw_roundtrip(svc.address("tcp"), big)
    assert reply.error == f"request of {len(big)} bytes exceeds --max-message-bytes=5000"
    many = encode(RewardRequest(request_id="many", items=items([3] * 11)))
    assert raw_roundtrip(svc.address("tcp"), many).error == "request has 11 items, the limit is --max-items=10"
    assert raw_roundtrip(svc.address("tcp"), encode(RewardRequest(request_id="ok", items=items([3])))).rewards == [1.0]


def test_item7_a_full_queue_answers_busy_at_once_and_the_queued_requests_are_scored(services, hang_funcs):
    svc = services("--fn", f"{hang_funcs}:slow", "--workers", "1", "--max-queued", "2")
    ctx, sock = dealer(svc.address("tcp"))
    try:
        for i in range(5):
            sock.send(encode(RewardRequest(request_id=f"r{i}", items=items([3]))))
        replies = {}
        deadline = time.monotonic() + 15
        while len(replies) < 5 and time.monotonic() < deadline:
            if sock.poll(1000):
                reply = decode(sock.recv(), RewardReply)
                replies[reply.request_id] = (reply.error, time.monotonic())
    finally:
        sock.close(linger=0)
        ctx.term()
    busy = sorted(rid for rid, (error, _) in replies.items() if error.startswith("busy: 2 requests"))
    scored = sorted(rid for rid, (error, _) in replies.items() if not error)
    assert busy == ["r2", "r3", "r4"] and scored == ["r0", "r1"], replies
    assert "--max-queued=2" in replies["r2"][0]
    assert max(replies[r][1] for r in busy) < min(replies[r][1] for r in scored)  # busy replies came first


def test_item7_queued_bytes_are_bounded_too(services, hang_funcs):
    svc = services("--fn", f"{hang_funcs}:slow", "--workers", "1", "--max-queued-bytes", "6000")
    ctx, sock = dealer(svc.address("tcp"))
    try:
        for i in range(2):  # ~3.5 kB each: the second would pass 6000 bytes
            sock.send(encode(RewardRequest(request_id=f"b{i}", items=items([3], reference="3" * 3500))))
        replies = [decode(sock.recv(), RewardReply) for _ in range(2) if sock.poll(10_000)]
    finally:
        sock.close(linger=0)
        ctx.term()
    assert [r.request_id for r in replies] == ["b1", "b0"]
    assert replies[0].error.startswith("busy: 1 requests (") and "--max-queued-bytes=6000" in replies[0].error


def test_item7_a_hanging_scorer_fails_its_requests_never_blocks_other_clients_and_sigterm_exits(services, hang_funcs):
    svc = services("--fn", f"{hang_funcs}:hang_on_request", "--workers", "1", "--score-timeout-s", "1")
    hung = [RewardItem(sample_id="h", prompt="", response="hang")]
    ctx, sock = dealer(svc.address("tcp"))
    try:
        started = time.monotonic()
        sock.send(encode(RewardRequest(request_id="hang-1", items=hung)))
        sock.send(encode(RewardRequest(request_id="hang-2", items=hung)))
        sock.send(encode(RewardRequest(request_id="fine", items=items([3]))))
        replies = {}
        while len(replies) < 3 and sock.poll(15_000):
            reply = decode(sock.recv(), RewardReply)
            replies[reply.request_id] = (reply, time.monotonic() - started)
    finally:
        sock.close(linger=0)
        ctx.term()
    assert set(replies) == {"hang-1", "hang-2", "fine"}, replies
    for rid in ("hang-1", "hang-2"):
        assert replies[rid][0].error.startswith("scoring timed out after --score-timeout-s=1.0"), replies[rid]
    assert replies["fine"][0].rewards == [1.0] and replies["fine"][1] < 6
    begun = time.monotonic()
    assert svc.stop(signal.SIGTERM) == 0  # two threads are still inside time.sleep(3600)
    assert time.monotonic() - begun < 10
    assert any("stopped on SIGTERM" in line and "2 timed out" in line for line in svc.lines), svc.lines


def test_item7_http_maps_a_scoring_timeout_to_504(services, hang_funcs):
    svc = services("--fn", f"{hang_funcs}:hang_on_request", "--score-timeout-s", "1", "--http", "127.0.0.1:0")
    status, body = http_raw(svc.address("http"), post(b'{"queries": ["hang"]}'))
    assert status == 504 and body["error"].startswith("scoring timed out after --score-timeout-s=1.0")


def test_item7_a_reused_request_id_with_other_items_is_scored_anew_and_the_cache_is_bounded_in_bytes(services):
    svc = services("--fn", "arith", "--log-requests", "--cache-bytes", "2000")
    first = raw_roundtrip(svc.address("tcp"), encode(RewardRequest(request_id="same", items=items([3]))))
    other = raw_roundtrip(svc.address("tcp"), encode(RewardRequest(request_id="same", items=items([4]))))
    again = raw_roundtrip(svc.address("tcp"), encode(RewardRequest(request_id="same", items=items([4]))))
    assert (first.rewards, other.rewards, again.rewards) == ([1.0], [0.0], [0.0])
    assert svc.scored_ids_once(["same", "same"]) == ["same", "same"]  # the exact retry came from the cache
    for i in range(20):  # ~300 bytes of cache each: "same" is evicted from a 2000-byte cache
        raw_roundtrip(svc.address("tcp"), encode(RewardRequest(request_id=f"fill{i}", items=items([3]))))
    raw_roundtrip(svc.address("tcp"), encode(RewardRequest(request_id="same", items=items([4]))))
    expected = ["same", "same", *(f"fill{i}" for i in range(20)), "same"]
    assert svc.scored_ids_once(expected).count("same") == 3


def test_item7_bad_limit_flags_exit_2_with_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "streamrft.rewards.service", "--fn", "arith", "--score-timeout-s", "0"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 2 and proc.stderr.strip() == "serve-reward: error: --score-timeout-s=0.0 must be > 0"


def test_item7_a_flood_of_large_requests_keeps_memory_bounded(services, hang_funcs):
    """1,500 requests of 100 kB (150 MB) at a slow service: the queue holds 8 of them, the rest are
    answered busy at once, and the service's peak RSS grows by far less than the flood."""
    svc = services("--fn", f"{hang_funcs}:slow", "--workers", "1", "--max-queued", "8")

    def rss_kb() -> int:
        with open(f"/proc/{svc.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1))

    start_kb, peak = rss_kb(), [0]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peak[0] = max(peak[0], rss_kb())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    ctx, sock = dealer(svc.address("tcp"))
    errors: Counter = Counter()
    try:
        pad = "x" * 100_000
        for i in range(1500):
            sock.send(encode(RewardRequest(request_id=f"flood{i}", items=[RewardItem(sample_id="0", prompt=pad,
                                                                                    response="3", reference="3")])))
            while sock.poll(0):
                errors[decode(sock.recv(), RewardReply).error[:6]] += 1
        while sum(errors.values()) < 1500 - 8 and sock.poll(10_000):
            errors[decode(sock.recv(), RewardReply).error[:6]] += 1
    finally:
        sampling.set()
        sampler.join()
        sock.close(linger=0)
        ctx.term()
    assert errors["busy: "] >= 1500 - 8 - 10, errors  # a few may have found a slot freed meanwhile
    growth_mb = (peak[0] - start_kb) / 1024
    assert growth_mb < 60, f"RSS grew {growth_mb:.0f} MB during a 150 MB flood"
    print(f"flood: RSS {start_kb} kB -> peak {peak[0]} kB")
