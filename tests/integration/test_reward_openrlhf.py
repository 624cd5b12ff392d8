"""OpenRLHF compatibility over the wire, and a real training run with a verl-style reward function.

- a real ``serve-reward --fn gsm8k --http`` process answers a body exactly as OpenRLHF's remote-RM client
  sends it (``requests.post(url, json={"query": ..., "prompts": ..., "labels": ...})``) with
  ``rewards`` and ``scores``, and refuses a body without gold answers with a 400 naming ``labels``;
- the ``protocol: openrlhf`` client scores through a small HTTP server written here that implements
  OpenRLHF's documented reply (``{"rewards", "scores", "extra_logs"}``);
- ``streamrft train`` runs 2 steps on the tiny arith setup with verl's ``compute_score`` signature.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from protocols import RewardItem
from streamrft.config.reward import RewardConfig, RewardSourceConfig
from streamrft.rewards.remote import RemoteRewardClient, RemoteRewardError
from streamrft.rewards.rules import RULES
from streamrft.rewards.scorer import build_reward_scorer
from tests.integration.conftest import REPO, arith_overrides
from tests.ports import free_port

# (prompt, response, gold answer): OpenRLHF's "query" is the prompt and response in one text.
GSM8K = [
    ("Q: Natalia sold 48 clips in April and half as many in May. How many in total?\nA: ",
     "48/2 = 24 in May, 48+24 = 72.\n#### 72", "72"),
    ("Q: Weng earns $12 an hour. She worked 50 minutes. How much did she earn?\nA: ",
     "12/60 = 0.2 per minute, 0.2*50 = 10.\n#### 10", "Weng earns 12/60 = $0.2 per minute.\n#### 10"),
    ("Q: Betty needs $100 and has half. Parents give $15, grandparents twice that. How much more?\nA: ",
     "50 + 15 + 30 = 95, so 100 - 95 = 6.\n#### 6", "5"),
    ("Q: A robe takes 2 bolts of blue and half that of white. How many bolts?\nA: ", "It takes \\boxed{3}", "3"),
]
EXPECTED = [1.0, 1.0, 0.0, 1.0]


def openrlhf_body(rows=GSM8K, labels=True) -> dict:
    """What openrlhf/utils/remote_rm_utils.py posts: query = prompt + response, labels = gold answers."""
    body = {"query": [p + r for p, r, _ in rows], "prompts": [p for p, _, _ in rows]}
    if labels:
        body["labels"] = [a for _, _, a in rows]
    return body


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def gsm8k_service():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrft.cli", "serve-reward", "--fn", "gsm8k", "--bind", "tcp://127.0.0.1:0",
         "--http", f"127.0.0.1:{port}"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("serve-reward: ready"):
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(30) and proc.poll() is None, "".join(lines)
        yield f"http://127.0.0.1:{port}/get_reward"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_serve_reward_answers_openrlhfs_body_with_rewards_and_scores(gsm8k_service):
    assert [RULES["gsm8k"](r, a) for _, r, a in GSM8K] == EXPECTED  # the values, from the rule itself
    status, reply = post(gsm8k_service, openrlhf_body())
    assert status == 200, reply
    assert reply == {"rewards": EXPECTED, "scores": EXPECTED}
    # The oldest client form, {"query"} alone, still needs the gold answers for a comparing rule:
    status, reply = post(gsm8k_service, {"query": openrlhf_body()["query"]})
    assert status == 400
    assert reply == {"error": 'gsm8k compares with a reference: the OpenRLHF body needs "labels" (the gold '
                              'answers), one per query'}


def test_a_body_without_gold_answers_gets_a_400_naming_labels(gsm8k_service):
    status, reply = post(gsm8k_service, openrlhf_body(labels=False))
    assert status == 400 and '"labels"' in reply["error"]
    body = openrlhf_body()
    body["labels"] = [""] * len(GSM8K)  # LightRFT's text path: labels present but empty
    status, reply = post(gsm8k_service, body)
    assert status == 400
    assert reply == {"error": 'gsm8k compares with a reference: "labels"[0] is empty (OpenRLHF\'s labels are the '
                              'gold answers)'}


class _OpenRLHFServer:
    """A remote RM as OpenRLHF documents one: POST {"query", "prompts", "labels"} -> {"rewards", "scores",
    "extra_logs"}; ``reply_keys`` picks which reward keys it sends. Records every body it receives."""

    def __init__(self, reply_keys=("rewards", "scores")) -> None:
        self.bodies: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                return None

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                rewards = [RULES["gsm8k"](q[len(p):], a) for q, p, a in zip(body["query"], body["prompts"], body["labels"])]
                reply = {key: rewards for key in reply_keys}
                reply["extra_logs"] = {"n": [1.0] * len(rewards)}
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/get_reward"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def gsm8k_items() -> list[RewardItem]:
    return [RewardItem(sample_id=f"s{i}", prompt=p, response=r, reference=a, label="gsm8k")
            for i, (p, r, a) in enumerate(GSM8K)]


@pytest.mark.parametrize("reply_keys", [("rewards", "scores"), ("scores",)])
def test_the_openrlhf_protocol_client_scores_through_an_openrlhf_server(reply_keys):
    server = _OpenRLHFServer(reply_keys)
    scorer = build_reward_scorer(RewardConfig(sources=[RewardSourceConfig(
        name="rm", type="remote", address=server.url, protocol="openrlhf")], timeout_s=10, retries=0))

    async def go():
        try:
            return await scorer.score(gsm8k_items())
        finally:
            await scorer.close()

    try:
        outcomes = asyncio.run(go())
    finally:
        server.close()
    assert [o.error for o in outcomes] == [""] * len(GSM8K)
    assert [o.reward for o in outcomes] == EXPECTED
    (body,) = server.bodies
    assert body == openrlhf_body()  # exactly OpenRLHF's fields: query = prompt + response, labels = references


def test_an_openrlhf_reply_without_rewards_fails_the_batch_naming_the_keys():
    server = _OpenRLHFServer(reply_keys=())
    client = RemoteRewardClient(server.url, timeout_s=10, retries=0, protocol="openrlhf")

    async def go():
        try:
            return await client.score(gsm8k_items())
        finally:
            await client.close()

    try:
        values = asyncio.run(go())
    finally:
        server.close()
    assert all(isinstance(v, RemoteRewardError) for v in values)
    assert "no 'rewards' (or 'scores') in the reply; its keys: extra_logs" in str(values[0])


def test_the_openrlhf_protocol_needs_an_http_address():
    with pytest.raises(ValueError, match=r"protocol='openrlhf' is an HTTP JSON body; give an http:// address"):
        RemoteRewardClient("tcp://127.0.0.1:5555", protocol="openrlhf")


VERL_FN = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # verl's custom_reward_function signature, unchanged
    if data_source != "arith":
        raise NotImplementedError(data_source)
    digits = solution_str.strip().split()[0] if solution_str.strip() else ""
    correct = digits == ground_truth.strip()
    return {"score": 1.0 if correct else 0.0, "acc": correct, "row": extra_info["index"]}
'''


@pytest.mark.slow
def test_streamrft_train_runs_two_steps_with_a_verl_compute_score(arith_dir, tmp_path):
    fn_file = tmp_path / "verl_reward.py"
    fn_file.write_text(VERL_FN)
    rows = [json.loads(line) for line in (arith_dir / "train.jsonl").open()]
    train_path = tmp_path / "train.jsonl"  # the arith rows with verl's extra_info column added
    train_path.write_text("".join(json.dumps({**row, "extra_info": {"index": i}}) + "\n" for i, row in enumerate(rows)))
    out = tmp_path / "run"
    overrides = arith_overrides(
        arith_dir, out, "train.max_steps=2", "data.eval_path=", f"sinks.jsonl={out / 'traj'}",
        f"data.train_path={train_path}",
        f"reward.sources=[{{name: verl, type: custom, fn: '{fn_file}:compute_score', convention: verl}}]",
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "streamrft.cli", "train", str(REPO / "pipelines/arith/config.yaml"),
                           *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    summary = json.loads(text.split("summary: ", 1)[1].splitlines()[0])
    assert summary["samples_admitted"] == summary["samples_trained"] == 2 * 32
    references = {row["prompt"]: row["reference"] for row in rows}
    indices: dict[str, set[float]] = {}
    for i, row in enumerate(rows):
        indices.setdefault(row["prompt"], set()).add(float(i))
    records = [json.loads(line) for path in sorted((out / "traj").rglob("*.jsonl")) for line in path.open()]
    assert len(records) == 2 * 32
    for rec in records:
        first = rec["response"].strip().split()[0] if rec["response"].strip() else ""
        expected = 1.0 if first == references[rec["prompt"]] else 0.0
        assert rec["reward"] == rec["reward_components"]["verl"] == expected
        assert rec["reward_components"]["verl/acc"] == expected  # verl's other dict key, kept as a component
        assert rec["reward_components"]["verl/row"] in indices[rec["prompt"]]  # extra_info came from the row
