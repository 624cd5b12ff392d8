"""Teacher clients for the TeacherFetcher stage: streamrft (ZeroMQ), SGLang and vLLM (HTTP).

All return the teacher's log-probs of each response token as a float32 tensor (R,).
- streamrft: TeacherRequest / TeacherReply over DEALER, request ids, timeout and retries.
- sglang: POST {address}/generate {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
  "return_logprob": true, "logprob_start_len": 0}; reads meta_info.input_token_logprobs
  (a list of [logprob, token_id, text], the first entry's logprob null).
- vllm: POST {address}/v1/completions {"model": name, "prompt": ids, "max_tokens": 1,
  "prompt_logprobs": 0}; reads choices[0].prompt_logprobs (a list of {token_id: {"logprob": x}},
  the first entry null).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid

import torch
import zmq
import zmq.asyncio

from protocols import ProtocolError, TeacherReply, TeacherRequest, decode, encode
from streamrft.rewards.remote import peek_request_id


class TeacherError(RuntimeError):
    pass


class StreamRFTTeacherClient:
    def __init__(self, address: str, timeout_s: float = 30.0, retries: int = 2, ctx: zmq.asyncio.Context | None = None):
        self.address, self.timeout_s, self.retries = address, timeout_s, retries
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.sock = None
        self.pending: dict[str, asyncio.Future] = {}
        self.reader: asyncio.Task | None = None

    def _connect(self) -> None:
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.address)
        self.reader = asyncio.create_task(self._read(self.sock), name="teacher-client-reader")

    async def _read(self, sock) -> None:
        """Match replies to pending calls until closed. A bad reply fails the call it names (or, naming
        none, lets that call time out); nothing a peer sends can end this task."""
        while True:
            try:
                frames = await sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                return  # the socket was closed: close() is under way
            try:
                reply = decode(frames[-1], TeacherReply)
            except ProtocolError as exc:  # the only error decode raises, whatever the bytes
                fut = self.pending.pop(peek_request_id(frames[-1]), None)
                if fut is not None and not fut.done():
                    fut.set_exception(TeacherError(f"teacher {self.address}: malformed reply: {exc}"))
                continue
            fut = self.pending.pop(reply.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)  # a late reply finds no pending future and is dropped

    async def logprobs(self, prompt_ids: torch.Tensor, response_ids: torch.Tensor) -> torch.Tensor:
        if self.sock is None:
            self._connect()
        ids = prompt_ids.tolist() + response_ids.tolist()
        request_id = uuid.uuid4().hex
        last = ""
        for _attempt in range(self.retries + 1):
            fut = asyncio.get_running_loop().create_future()
            self.pending[request_id] = fut
            await self.sock.send_multipart([b"", encode(TeacherRequest(request_id=request_id, token_ids=[ids], prompt_lens=[len(prompt_ids)]))])
            try:
                reply = await asyncio.wait_for(fut, self.timeout_s)
            except asyncio.TimeoutError:
                self.pending.pop(request_id, None)
                last = f"no reply from teacher {self.address} within {self.timeout_s}s"
                continue
            if reply.error:
                raise TeacherError(f"teacher {self.address}: {reply.error}")
            if len(reply.logprobs) != 1:
                raise TeacherError(f"teacher {self.address} answered one sequence with {len(reply.logprobs)} log-prob lists")
            return _check(torch.tensor(reply.logprobs[0], dtype=torch.float32), len(response_ids), self.address)
        raise TeacherError(f"{last} after {self.retries + 1} attempts")

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        if self.sock is not None:
            self.sock.close(0)


def _check(logprobs: torch.Tensor, n: int, address: str) -> torch.Tensor:
    if logprobs.shape != (n,):
        raise TeacherError(f"teacher {address} returned {tuple(logprobs.shape)} log-probs for {n} response tokens")
    if not torch.isfinite(logprobs).all():
        raise TeacherError(f"teacher {address} returned non-finite log-probs")
    return logprobs


def _post_json(url: str, body: dict, timeout_s: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


class HTTPTeacherClient:
    """SGLang (`kind="sglang"`) or vLLM OpenAI-compatible (`kind="vllm"`) teacher server."""

    def __init__(self, address: str, kind: str, timeout_s: float = 30.0, model_name: str = ""):
        self.address, self.kind, self.timeout_s, self.model_name = address.rstrip("/"), kind, timeout_s, model_name

    def request_body(self, ids: list[int]) -> tuple[str, dict]:
        if self.kind == "sglang":
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0}
            return f"{self.address}/generate", body
        body = {"model": self.model_name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
        return f"{self.address}/v1/completions", body

    def parse(self, reply: dict, ids: list[int]) -> list[float]:
        """Log-prob of every token after the first (index 0 has no context)."""
        if self.kind == "sglang":
            entries = reply["meta_info"]["input_token_logprobs"]
            return [float(e[0]) for e in entries[1 : len(ids)]]
        entries = reply["choices"][0]["prompt_logprobs"]
        return [float(entries[t][str(ids[t])]["logprob"]) for t in range(1, len(ids))]

    async def logprobs(self, prompt_ids: torch.Tensor, response_ids: torch.Tensor) -> torch.Tensor:
        ids = prompt_ids.tolist() + response_ids.tolist()
        url, body = self.request_body(ids)
        try:
            reply = await asyncio.to_thread(_post_json, url, body, self.timeout_s)
            all_lp = self.parse(reply, ids)
        except (OSError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise TeacherError(f"{self.kind} teacher {self.address}: {type(exc).__name__}: {exc}") from None
        return _check(torch.tensor(all_lp[len(prompt_ids) - 1 :], dtype=torch.float32), len(response_ids), self.address)

    async def close(self) -> None:
        return None


def build_teacher_client(teacher_cfg, timeout_s: float, retries: int):
    if teacher_cfg.type == "none":
        return None
    if teacher_cfg.type == "streamrft":
        return StreamRFTTeacherClient(teacher_cfg.address, timeout_s, retries)
    return HTTPTeacherClient(teacher_cfg.address, teacher_cfg.type, timeout_s)
