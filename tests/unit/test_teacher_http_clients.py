"""SGLang and vLLM teacher adapters against servers that implement the documented HTTP shapes.

SGLang and vLLM cannot run here; these stand-in servers answer exactly the calls the adapters make:
SGLang ``POST /generate`` with ``return_logprob`` / ``logprob_start_len=0`` / ``max_new_tokens=0``
(meta_info.input_token_logprobs: [logprob, token_id, text], the first logprob null), and vLLM's
OpenAI-compatible ``POST /v1/completions`` with ``prompt_logprobs`` (choices[0].prompt_logprobs:
a list of {token_id: {"logprob": x, ...}}, the first entry null).
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from streamrft.teacher.client import HTTPTeacherClient, TeacherError


def fake_logprob(position: int, token: int) -> float:
    return -0.1 * position - 0.01 * token


class Handler(BaseHTTPRequestHandler):
    seen: list = []

    def log_message(self, *args):  # keep test output clean
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Handler.seen.append((self.path, body))
        if self.path == "/generate":
            assert body["sampling_params"]["max_new_tokens"] == 0 and body["return_logprob"] and body["logprob_start_len"] == 0
            ids = body["input_ids"]
            out = {"meta_info": {"input_token_logprobs": [[None if t == 0 else fake_logprob(t, i), i, None] for t, i in enumerate(ids)]}}
        elif self.path == "/v1/completions":
            ids = body["prompt"]
            out = {"choices": [{"prompt_logprobs": [None] + [{str(i): {"logprob": fake_logprob(t, i), "rank": 1}} for t, i in enumerate(ids) if t > 0]}]}
        else:
            self.send_response(404)
            self.end_headers()
            return
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_http_teacher_returns_response_token_logprobs(server, kind):
    client = HTTPTeacherClient(server, kind, timeout_s=10, model_name="teacher")
    prompt, response = torch.tensor([5, 6, 7]), torch.tensor([8, 9])
    got = asyncio.run(client.logprobs(prompt, response))
    want = torch.tensor([fake_logprob(3, 8), fake_logprob(4, 9)], dtype=torch.float32)
    assert torch.allclose(got, want)


def test_unreachable_teacher_is_a_clear_error():
    client = HTTPTeacherClient("http://127.0.0.1:9", "sglang", timeout_s=2)
    with pytest.raises(TeacherError, match="sglang teacher http://127.0.0.1:9"):
        asyncio.run(client.logprobs(torch.tensor([1]), torch.tensor([2])))
