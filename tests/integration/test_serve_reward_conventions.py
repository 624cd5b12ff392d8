"""``streamrft serve-reward --convention trl|verl|openrlhf``: a reward function written for another framework,
served unchanged by a real service process, answering both wires: StreamRFT's msgpack RewardRequest over
ZeroMQ (with a conversational row's messages in the item's columns) and OpenRLHF's HTTP body."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest
import zmq

from protocols import RewardItem, RewardReply, RewardRequest, decode, encode
from streamrft.rewards.sources import resolve_reward_function
from tests.integration._services import ServiceProcess
from tests.integration.conftest import REPO
from tests.ports import free_port

HERE = "tests.integration.test_serve_reward_conventions"


def _last_int(text: str) -> str | None:
    found = re.findall(r"-?\d+", text)
    return found[-1] if found else None


def trl_conversational(prompts, completions, solution, **kwargs):
    """TRL shape on conversational rows: completion[0]["content"] is the text; prompts are message lists."""
    assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in prompts), prompts
    return [float(_last_int(c[0]["content"]) == s) for c, s in zip(completions, solution)]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's shape: per sample, a dict with 'score' (data_source: the label; OpenRLHF's body has none)."""
    assert data_source in ("arith", "default"), data_source
    return {"score": float(_last_int(solution_str) == ground_truth), "len": len(solution_str)}


def reward_func(queries, prompts, labels):
    """OpenRLHF's shape: queries are prompt + response, labels the gold answers."""
    return {"rewards": [float(_last_int(q[len(p):]) == a) for q, p, a in zip(queries, prompts, labels)]}


ROWS = [("23+45=", "it is 68", "68"), ("7*6=", "41", "42"), ("9-2=", "7", "7")]  # prompt, response, gold
EXPECTED = [1.0, 0.0, 1.0]


class Service(ServiceProcess):
    """A real ``streamrft serve-reward`` process; ``zmq`` and ``http`` are its bound addresses."""

    def __init__(self, fn: str, convention: str) -> None:
        port = free_port()
        super().__init__("serve-reward", ["streamrft.cli", "serve-reward", "--fn", f"{HERE}:{fn}", "--convention",
                                          convention, "--bind", "tcp://127.0.0.1:0", "--http", f"127.0.0.1:{port}"],
                         ready_timeout_s=60, stop_timeout_s=15)
        self.zmq = self.address("tcp")
        self.http = f"http://127.0.0.1:{port}/get_reward"

    def request(self, items: list[RewardItem]) -> RewardReply:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.zmq)
            sock.send(encode(RewardRequest(request_id="r1", items=items)))
            assert sock.poll(30_000), "no reply within 30 s"
            return decode(sock.recv(), RewardReply)
        finally:
            sock.close()
            ctx.term()

    def post_openrlhf(self) -> dict:
        body = {"query": [p + r for p, r, _ in ROWS], "prompts": [p for p, _, _ in ROWS], "labels": [a for *_, a in ROWS]}
        req = urllib.request.Request(self.http, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())


def _items(conversational: bool = False) -> list[RewardItem]:
    return [RewardItem(sample_id=str(i), prompt=p, response=r, reference=a, label="arith",
                       columns={"prompt": [{"role": "user", "content": p}]} if conversational else {})
            for i, (p, r, a) in enumerate(ROWS)]


@pytest.mark.parametrize("fn,convention", [("compute_score", "verl"), ("reward_func", "openrlhf")])
def test_a_verl_or_openrlhf_function_is_served_unchanged_on_both_wires(fn, convention):
    service = Service(fn, convention)
    try:
        reply = service.request(_items())
        assert reply.error == "" and reply.rewards == EXPECTED
        assert service.post_openrlhf() == {"rewards": EXPECTED, "scores": EXPECTED}
    finally:
        service.stop()
    assert service.proc.returncode == 0, "\n".join(service.lines)


def test_a_trl_function_is_served_unchanged_and_sees_conversational_rows():
    service = Service("trl_conversational", "trl")
    try:
        reply = service.request(_items(conversational=True))
        assert reply.error == "" and reply.rewards == EXPECTED
    finally:
        service.stop()


def test_a_foreign_signature_without_the_flag_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"set --convention trl$"):
        resolve_reward_function(f"{HERE}:trl_conversational")
    with pytest.raises(ValueError, match=r"--convention verl is for custom functions .*'gsm8k' is a built-in rule"):
        resolve_reward_function("gsm8k", "verl")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "streamrft.cli", "serve-reward", "--fn", f"{HERE}:reward_func"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "is a reward function in the openrlhf convention" in done.stderr
    assert "set --convention openrlhf" in done.stderr
