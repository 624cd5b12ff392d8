"""``streamrft serve-teacher``: per-token log-probs of given token ids from a local model.

    streamrft serve-teacher --model DIR --bind tcp://127.0.0.1:5556 [--device cpu] [--dtype float32]

A ROUTER socket speaking protocols.TeacherRequest -> TeacherReply (msgpack, never pickle). A malformed
frame, a version mismatch or a bad request gets an error reply; the service keeps running. Prints
``serve-teacher: listening on <address>`` then ``serve-teacher: ready``. SIGTERM / SIGINT stop it.
"""

from __future__ import annotations

import argparse
import signal
import sys

import zmq

from protocols import ProtocolError, TeacherReply, TeacherRequest, decode, encode


def _load(model_dir: str, device: str, dtype: str):
    import torch

    from streamrft.models.tiny import load_policy

    model, tokenizer = load_policy(model_dir, dtype=getattr(torch, dtype), device=torch.device(device))
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return model, pad


def serve_teacher(model_dir: str, bind: str = "tcp://127.0.0.1:0", device: str = "cpu", dtype: str = "float32") -> None:
    from streamrft.teacher.scoring import sequence_logprobs

    model, pad = _load(model_dir, device, dtype)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(bind)
    print(f"serve-teacher: listening on {sock.getsockopt_string(zmq.LAST_ENDPOINT)}", flush=True)
    print("serve-teacher: ready", flush=True)
    stopping = []

    def stop(signum, _frame):
        stopping.append(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    try:
        while not stopping:
            if not dict(poller.poll(200)):
                continue
            frames = sock.recv_multipart()
            envelope, body = frames[:-1], frames[-1]
            try:
                req = decode(body, TeacherRequest)
            except ProtocolError as exc:
                sock.send_multipart([*envelope, encode(TeacherReply(request_id="", error=str(exc)))])
                continue
            try:
                logprobs = sequence_logprobs(model, req.token_ids, req.prompt_lens, pad)
                reply = TeacherReply(request_id=req.request_id, logprobs=logprobs)
            except (ValueError, RuntimeError) as exc:
                reply = TeacherReply(request_id=req.request_id, error=f"{type(exc).__name__}: {exc}")
            sock.send_multipart([*envelope, encode(reply)])
    finally:
        sock.close(0)
        ctx.term()
        print(f"serve-teacher: stopped ({stopping[0] if stopping else 'exit'})", flush=True)


def serve_teacher_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="streamrft serve-teacher", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory of the teacher")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="ZeroMQ address to bind (loopback by default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    serve_teacher(args.model, args.bind, args.device, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(serve_teacher_main(sys.argv[1:]))
