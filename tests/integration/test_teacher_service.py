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
from tests.integration.conftest import REPO
from tests.ports import free_port

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


# --- issue 16 item 5: a bad request gets an error reply, never an exit --------------------------------

ALPHABET = "0123456789+-=abcdefghij"


@pytest.fixture(scope="module")
def tiny_teacher_dir(tmp_path_factory):
    """A randomly initialised tiny Qwen2 (vocab 3 + 23 characters), built in a second, no hub."""
    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2

    out = str(tmp_path_factory.mktemp("tiny_teacher"))
    tok = build_char_tokenizer(out, ALPHABET)
    build_tiny_qwen2(out, tok, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                     max_position_embeddings=256)
    return out


class TeacherProcess:
    def __init__(self, model_dir: str, *extra: str) -> None:
        self.address = f"tcp://127.0.0.1:{free_port()}"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streamrft.cli", "serve-teacher", "--model", model_dir, "--bind", self.address, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
        )
        lines = []
        deadline = time.monotonic() + 60
        for line in self.proc.stdout:
            lines.append(line)
            if "serve-teacher: ready" in line:
                break
            assert time.monotonic() < deadline, "".join(lines)
        assert self.proc.poll() is None, "".join(lines)
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 20000)
        self.sock.connect(self.address)

    def ask(self, frame: bytes) -> TeacherReply:
        self.sock.send_multipart([b"", frame])
        return decode(self.sock.recv_multipart()[-1], TeacherReply)

    def good(self) -> TeacherReply:
        reply = self.ask(encode(TeacherRequest(request_id="good", token_ids=[[4, 5, 6, 7]], prompt_lens=[2])))
        assert not reply.error and len(reply.logprobs[0]) == 2, reply
        return reply

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def tiny_teacher(tiny_teacher_dir):
    """start(*flags): a serve-teacher process with those flags, shared by the tests of this module
    (each process takes seconds to import torch; every test checks it still answers afterwards)."""
    started: dict[tuple[str, ...], TeacherProcess] = {}

    def start(*extra: str) -> TeacherProcess:
        if extra not in started or started[extra].proc.poll() is not None:
            started[extra] = TeacherProcess(tiny_teacher_dir, *extra)
        return started[extra]

    yield start
    for t in started.values():
        t.close()


VOCAB = 3 + len(ALPHABET)


@pytest.mark.parametrize("ids, prompt_lens, expected", [
    ([[4, VOCAB]], [1], f"sequence 0: token id {VOCAB} is outside the vocabulary \\[0, {VOCAB}\\)"),
    ([[4, 5], [6, -1, 7]], [1, 1], f"sequence 1: token id -1 is outside the vocabulary \\[0, {VOCAB}\\)"),
    ([[4, 5], [6, 7]], [1], "prompt_lens has 1 entries for 2 sequences"),
    ([[4, 5]], [3], "sequence 0: prompt_len=3 must be in \\[1, 2\\]"),
    ([[]], [0], "sequence 0: prompt_len=0 must be in \\[1, 0\\]"),
    ([[4, 5], [4] * 257], [1, 1], "sequence 1: 257 tokens exceed the model's max_position_embeddings=256"),
])
def test_item5_teacher_rejects_a_bad_request_with_an_error_reply_and_keeps_serving(tiny_teacher, ids, prompt_lens,
                                                                                   expected):
    import re

    teacher = tiny_teacher()
    reply = teacher.ask(encode(TeacherRequest(request_id="bad", token_ids=ids, prompt_lens=prompt_lens)))
    assert reply.request_id == "bad" and re.search(expected, reply.error), reply
    teacher.good()
    assert teacher.proc.poll() is None


def test_item5_teacher_answers_a_message_nested_1000_deep_and_a_garbage_frame_with_errors(tiny_teacher):
    teacher = tiny_teacher()
    assert "nests deeper than" in teacher.ask(b"\x91" * 1000 + b"\xc0").error
    deep = b"\x84\xa4kind\xaeTeacherRequest\xb0protocol_version\x01\xaarequest_id\xa2d1\xa1x" + b"\x81\xa1k" * 1000 + b"\xc0"
    reply = teacher.ask(deep)
    assert reply.request_id == "" and "nests deeper than" in reply.error
    assert "malformed frame" in teacher.ask(b"\xc1\xc1").error
    teacher.good()


def test_item5_teacher_size_limits_reject_large_requests_with_an_error(tiny_teacher):
    teacher = tiny_teacher("--max-tokens", "100", "--max-message-bytes", "4000")
    reply = teacher.ask(encode(TeacherRequest(request_id="many", token_ids=[[4] * 60, [5] * 60], prompt_lens=[1, 1])))
    assert reply.request_id == "many" and reply.error == "request holds 120 tokens, the limit is --max-tokens=100"
    big = encode(TeacherRequest(request_id="big", token_ids=[[200] * 2000], prompt_lens=[1]))
    reply = teacher.ask(big)
    assert reply.error == f"request of {len(big)} bytes exceeds --max-message-bytes=4000"
    teacher.good()


def test_item5_teacher_logprobs_are_computed_in_head_chunks_and_equal_a_full_forward(tiny_teacher_dir):
    from transformers import AutoModelForCausalLM

    from streamrft.teacher.scoring import sequence_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_teacher_dir).eval()
    seqs, prompt_lens = [[4, 5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18]], [2, 1, 5]
    rows_seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: rows_seen.append(i[0].shape[0]))
    try:
        got = sequence_logprobs(model, seqs, prompt_lens, pad_id=0, chunk_tokens=3)
    finally:
        hook.remove()
    # Scored positions: 5 + 2 + 0 = 7, through the head 3 rows at a time; never the whole (3 x 7 x vocab).
    assert rows_seen == [3, 3, 1]
    # Forwards of at most 8 padded tokens (by length: [11..13] alone, [14..18] alone but with nothing to
    # score so no forward at all, then [4..10]) give the same numbers, each sequence back in its place.
    forwards = []
    hook = model.get_decoder().register_forward_hook(lambda m, i, o: forwards.append(tuple(o.last_hidden_state.shape[:2])))
    try:
        split = sequence_logprobs(model, seqs, prompt_lens, pad_id=0, chunk_tokens=2, batch_tokens=8)
    finally:
        hook.remove()
    assert forwards == [(1, 3), (1, 7)]
    for a, b in zip(split, got):
        assert a == pytest.approx(b, abs=1e-6)
    for ids, p, lp in zip(seqs, prompt_lens, got):
        with torch.no_grad():  # independent: each sequence alone, unpadded, full logits in float64
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
        want = [logp[t - 1, ids[t]].item() for t in range(p, len(ids))]
        assert lp == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("case", ["missing-model-dir", "bad-bind", "port-in-use"])
def test_item5_teacher_start_up_errors_are_one_line_and_exit_status_2(tiny_teacher_dir, tmp_path, case):
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    model, bind = tiny_teacher_dir, f"tcp://127.0.0.1:{free_port()}"
    if case == "missing-model-dir":
        model = str(tmp_path / "no-such-model")
    elif case == "bad-bind":
        bind = "tcp://not-an-address:x"
    else:
        bind = f"tcp://127.0.0.1:{port}"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "streamrft.cli", "serve-teacher", "--model", model, "--bind", bind],
            capture_output=True, text=True, timeout=60, cwd=REPO,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
        )
    finally:
        holder.close()
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("serve-teacher: error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    expected = {"missing-model-dir": "has no config.json", "bad-bind": "cannot bind --bind 'tcp://not-an-address:x'",
                "port-in-use": "Address already in use"}[case]
    assert expected in lines[0]


def test_item6_teacher_client_reader_survives_bad_replies_and_a_bad_reply_fails_its_call():
    """A fake teacher answers with a malformed reply naming the request (that call fails at once), a
    1000-deep frame (that call times out) and then a good reply: the reader is still there to take it."""
    import msgspec
    import zmq
    import zmq.asyncio

    from streamrft.teacher.client import StreamRFTTeacherClient, TeacherError

    async def run():
        ctx = zmq.asyncio.Context()
        server = ctx.socket(zmq.ROUTER)
        server.setsockopt(zmq.LINGER, 0)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client = StreamRFTTeacherClient(f"tcp://127.0.0.1:{port}", timeout_s=1.0, retries=0, ctx=ctx)
        answers = [
            lambda rid: msgspec.msgpack.encode({"kind": "TeacherReply", "protocol_version": 1, "request_id": rid,
                                                "logprobs": "not a list"}),
            lambda rid: b"\x91" * 1000 + b"\xc0",
            lambda rid: encode(TeacherReply(request_id=rid, logprobs=[[-0.5, -0.25]])),
        ]

        async def serve():
            for answer in answers:
                frames = await server.recv_multipart()
                rid = decode(frames[-1], TeacherRequest).request_id
                await server.send_multipart([*frames[:-1], answer(rid)])

        server_task = asyncio.create_task(serve())
        outcomes = []
        try:
            for _ in answers:
                try:
                    outcomes.append(await client.logprobs(torch.tensor([4, 5]), torch.tensor([6, 7])))
                except TeacherError as exc:
                    outcomes.append(str(exc))
            await asyncio.wait_for(server_task, 5)
            reader_alive = not client.reader.done()
        finally:
            await client.close()
            server.close(0)
            ctx.term()
        return outcomes, reader_alive

    outcomes, reader_alive = asyncio.run(run())
    assert "malformed reply" in outcomes[0] and "invalid TeacherReply message" in outcomes[0]
    assert "no reply from teacher" in outcomes[1]
    assert torch.equal(outcomes[2], torch.tensor([-0.5, -0.25])) and reader_alive
