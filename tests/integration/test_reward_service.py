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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """One serve-reward subprocess; its output lines are collected by a reader thread."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streamrft.rewards.service", *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(20):
            self.stop(signal.SIGKILL)
            raise AssertionError(f"serve-reward not ready in 20 s; output: {self.lines}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("serve-reward: ready"):
                self._ready.set()
        self._ready.set()  # exited: stop waiting

    def address(self, scheme: str) -> str:
        for line in self.lines:
            m = re.match(rf"serve-reward: listening on ({scheme}://\S+)", line)
            if m:
                return m.group(1)
        raise AssertionError(f"no {scheme} address in {self.lines}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(timeout=5)
        self._reader.join(timeout=5)
        self.proc.stdout.close()
        return rc

    def scored_ids(self) -> list[str]:
        return [m.group(1) for line in self.lines if (m := re.search(r"scoring request (\S+)", line))]


@pytest.fixture
def services():
    started: list[Service] = []

    def start(*args: str) -> Service:
        started.append(Service(*args))
        return started[-1]

    yield start
    for svc in started:
        svc.stop(signal.SIGKILL)


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

    (results, second), client = run_client(f"tcp://127.0.0.1:{port}", go, timeout_s=1.0, retries=8, max_concurrency=4)
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
