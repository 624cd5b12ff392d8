"""``streamrft serve-teacher``: per-token log-probs of given token ids from a local model.

    streamrft serve-teacher --model DIR --bind tcp://127.0.0.1:5556 [--device cpu] [--dtype float32]
                            [--max-message-bytes 16777216] [--max-tokens 65536]

A ROUTER socket speaking protocols.TeacherRequest -> TeacherReply (msgpack, never pickle). A malformed
frame, a version mismatch or a bad request gets an error reply and the service keeps running: token ids
outside [0, vocab), ``prompt_lens`` not one per sequence or outside [1, len], a sequence longer than the
model's max_position_embeddings, a frame over
``--max-message-bytes`` or more than ``--max-tokens`` tokens in one request (ZeroMQ drops a frame over
twice the byte limit unread; the sender's request then times out). The output head runs over the scored
positions in chunks (streamrft.teacher.scoring), so no request materialises full-vocabulary logits.
Prints ``serve-teacher: listening on <address>`` then ``serve-teacher: ready``. SIGTERM / SIGINT stop it.
Start-up errors (no model at --model, an address that cannot be bound) are one line and exit status 2.
"""

from __future__ import annotations

import argparse
import signal
import sys

import zmq

from protocols import ProtocolError, TeacherReply, TeacherRequest, decode, encode
from streamrft.rewards.remote import peek_request_id

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_TOKENS = 65536


def _log(msg: str) -> None:
    print(f"serve-teacher: {msg}", flush=True)


def _load(model_dir: str, device: str, dtype: str):
    import torch

    from streamrft.models.tiny import load_policy

    model, tokenizer = load_policy(model_dir, dtype=getattr(torch, dtype), device=torch.device(device))
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return model, pad


class TeacherService:
    """Answers one request frame with one reply frame; any failure becomes an error reply."""

    def __init__(self, model, pad_id: int, max_message_bytes: int = MAX_MESSAGE_BYTES, max_tokens: int = MAX_TOKENS):
        self.model, self.pad_id = model, pad_id
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.max_len = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.max_message_bytes, self.max_tokens = max_message_bytes, max_tokens
        self.n_requests = self.n_errors = 0

    def answer(self, body: bytes) -> bytes:
        from streamrft.teacher.scoring import sequence_logprobs, validate_request

        self.n_requests += 1
        if len(body) > self.max_message_bytes:
            return self._error("", f"request of {len(body)} bytes exceeds --max-message-bytes={self.max_message_bytes}")
        try:
            req = decode(body, TeacherRequest, max_bytes=self.max_message_bytes)
        except ProtocolError as exc:
            return self._error(peek_request_id(body), str(exc))
        try:
            validate_request(req.token_ids, req.prompt_lens, self.vocab_size, self.max_tokens, self.max_len)
            logprobs = sequence_logprobs(self.model, req.token_ids, req.prompt_lens, self.pad_id)
        except ValueError as exc:
            return self._error(req.request_id, str(exc))
        except Exception as exc:  # a model failure (out of memory, a kernel error) fails this request only
            return self._error(req.request_id, f"{type(exc).__name__}: {exc}")
        return encode(TeacherReply(request_id=req.request_id, logprobs=logprobs))

    def _error(self, request_id: str, message: str) -> bytes:
        # Not logged per request: the reply carries the reason to the client, which reports it, and a
        # launcher that stops reading this process's stdout after "ready" must not block it on a full pipe.
        self.n_errors += 1
        return encode(TeacherReply(request_id=request_id, error=message))


def serve_teacher(model_dir: str, bind: str = "tcp://127.0.0.1:0", device: str = "cpu", dtype: str = "float32",
                  max_message_bytes: int = MAX_MESSAGE_BYTES, max_tokens: int = MAX_TOKENS) -> None:
    """Serve until SIGTERM / SIGINT. ValueError / zmq.ZMQError / OSError for a bad setting, before the
    model is loaded where it can be told without it."""
    if max_message_bytes < 1 or max_tokens < 1:
        raise ValueError(f"--max-message-bytes={max_message_bytes} and --max-tokens={max_tokens} must be >= 1")
    if not bind.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"--bind {bind!r} must be a ZeroMQ address such as tcp://127.0.0.1:5556")
    from streamrft.models.hub import resolve_model_dir

    # told before torch is even imported: a directory (e.g. pipelines/arith/prepare.py's sft/) or a cached hub id
    model_dir = resolve_model_dir(model_dir, "--model")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes + 4096)
    sock.setsockopt(zmq.RCVHWM, 64)  # requests buffered per peer; past it libzmq stops reading (backpressure)
    stopping: list[str] = []
    try:
        try:
            sock.bind(bind)  # before the model load: a bad address is told at once
        except zmq.ZMQError as exc:
            raise ValueError(f"cannot bind --bind {bind!r}: {exc}") from None
        model, pad = _load(model_dir, device, dtype)
        service = TeacherService(model, pad, max_message_bytes, max_tokens)
        _log(f"listening on {sock.getsockopt_string(zmq.LAST_ENDPOINT)}")
        _log("ready")

        def stop(signum, _frame):
            stopping.append(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not stopping:
            if not dict(poller.poll(200)):
                continue
            frames = sock.recv_multipart()
            sock.send_multipart([*frames[:-1], service.answer(frames[-1])])
        _log(f"stopped ({stopping[0]}): {service.n_requests} requests, {service.n_errors} errors")
    finally:
        sock.close(0)
        ctx.term()


def serve_teacher_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="streamrft serve-teacher", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the teacher: a Hugging Face model directory or a hub id in the "
                        "local Hugging Face cache")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="ZeroMQ address to bind (loopback by default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES, help="largest request frame")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="most tokens (all sequences) in one request")
    args = parser.parse_args(argv)
    try:
        serve_teacher(args.model, args.bind, args.device, args.dtype, args.max_message_bytes, args.max_tokens)
    except (ValueError, OSError, zmq.ZMQError) as exc:
        print(f"serve-teacher: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(serve_teacher_main(sys.argv[1:]))
