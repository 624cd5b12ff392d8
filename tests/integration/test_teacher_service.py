"""The teacher log-prob service: a real process, real sockets, numbers equal to a local forward."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
import torch

from protocols import TeacherReply, TeacherRequest, decode, encode
from tests.integration.conftest import REPO, free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def teacher_service(arith_dir):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrft.cli", "serve-teacher", "--model", str(arith_dir / "sft"), "--bind", f"tcp://127.0.0.1:{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
    )
    deadline = time.monotonic() + 60
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "serve-teacher: ready" in line:
            break
        assert time.monotonic() < deadline, "".join(lines)
    try:
        yield f"tcp://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def local_logprobs(model_dir, ids: list[int], prompt_len: int) -> torch.Tensor:
    """Independent computation: one unpadded full forward, log-softmax, gather."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return torch.tensor([logp[t - 1, ids[t]].item() for t in range(prompt_len, len(ids))], dtype=torch.float64)


def test_teacher_logprobs_equal_a_local_forward(arith_dir, teacher_service):
    from streamrft.teacher.client import StreamRFTTeacherClient

    address, _ = teacher_service
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(arith_dir / "sft")
    prompts = ["12+7=", "3+45=", "99+99="]
    responses = ["19", "48 ", "198"]

    async def fetch():
        client = StreamRFTTeacherClient(address, timeout_s=30)
        try:
            return await asyncio.gather(*[
                client.logprobs(torch.tensor(tok.encode(p)), torch.tensor(tok.encode(r))) for p, r in zip(prompts, responses)
            ])
        finally:
            await client.close()

    got = asyncio.run(fetch())
    for p, r, lp in zip(prompts, responses, got):
        ids = tok.encode(p) + tok.encode(r)
        want = local_logprobs(arith_dir / "sft", ids, len(tok.encode(p)))
        assert lp.shape == want.shape
        assert torch.allclose(lp.double(), want, atol=1e-5), (lp, want)


def test_teacher_answers_a_version_mismatch_with_an_error_and_keeps_serving(teacher_service):
    import msgspec
    import zmq

    address, proc = teacher_service
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 20000)
    sock.connect(address)
    try:
        bad = msgspec.msgpack.encode({"kind": "TeacherRequest", "protocol_version": 99, "request_id": "x", "token_ids": [[1, 2]], "prompt_lens": [1]})
        sock.send_multipart([b"", bad])
        reply = decode(sock.recv_multipart()[-1], TeacherReply)
        assert "protocol version mismatch: peer sent version 99" in reply.error
        sock.send_multipart([b"", encode(TeacherRequest(request_id="ok", token_ids=[[1, 2, 3]], prompt_lens=[1]))])
        reply = decode(sock.recv_multipart()[-1], TeacherReply)
        assert reply.request_id == "ok" and not reply.error and len(reply.logprobs[0]) == 2
        assert proc.poll() is None
    finally:
        sock.close(0)
        ctx.term()
