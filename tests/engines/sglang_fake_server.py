"""A stand-in SGLang server for tests: stdlib HTTP, the native endpoints SGLangEngine calls, a real HF model.

Run: ``python tests/engines/sglang_fake_server.py MODEL_DIR`` → prints ``PORT <n>`` and serves on 127.0.0.1.

Endpoints and fields follow SGLang's ``http_server.py`` / ``io_struct.py``:
``/generate`` (input_ids, sampling_params{temperature, top_p, top_k, max_new_tokens, stop_token_ids,
sampling_seed}, return_logprob → output_ids, meta_info{finish_reason{type}, output_token_logprobs}),
``/release_memory_occupation``, ``/resume_memory_occupation``, ``/update_weights_from_tensor``,
``/init_weights_update_group``, ``/update_weights_from_distributed``, ``/get_weight_version``.

Decoding is a plain full-forward loop: ``temperature == 0`` is argmax; otherwise token ~ softmax(logits/T)
with a generator seeded by ``sampling_seed``, log-prob = log_softmax(logits/T)[token] (SGLang's default).
CPU tensors in update_weights_from_tensor arrive as file descriptors through multiprocessing's resource
sharer, which authenticates with the sender's authkey: pass it hex-encoded in STREAMRFT_FAKE_SGLANG_AUTHKEY.
"""

from __future__ import annotations

import base64
import io
import json
import multiprocessing
import os
import pickle
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from transformers import AutoModelForCausalLM

from streamrft.engines.sglang import join_weight_group


class _TensorUnpickler(pickle.Unpickler):
    """Only what torch's ForkingPickler needs to rebuild tensors (like SGLang's own safe unpickler)."""

    def find_class(self, module: str, name: str):
        if module.split(".")[0] in ("torch", "multiprocessing", "collections") or (module, name) == ("builtins", "getattr"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"blocked {module}.{name}")


class FakeSGLang:
    def __init__(self, model_path: str):
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.lock = threading.Lock()
        self.released = False
        self.weight_version = "default"
        self.groups: dict[str, object] = {}

    def generate(self, body: dict) -> dict:
        if self.released:
            raise ValueError("memory is released; call /resume_memory_occupation first")
        sp = body.get("sampling_params") or {}
        ids = list(body["input_ids"])
        temperature = float(sp.get("temperature", 1.0))
        stop = set(sp.get("stop_token_ids") or [])
        gen = torch.Generator().manual_seed(int(sp.get("sampling_seed") or 0))
        out_ids, logps, reason = [], [], "length"
        with self.lock, torch.no_grad():
            for _ in range(int(sp.get("max_new_tokens", 16))):
                logits_V = self.model(torch.tensor([ids + out_ids])).logits[0, -1].float()
                if temperature == 0:
                    token = int(logits_V.argmax())
                    logp = float(torch.log_softmax(logits_V, -1)[token])
                else:
                    logp_V = torch.log_softmax(logits_V / temperature, -1)
                    token = int(torch.multinomial(logp_V.exp(), 1, generator=gen))
                    logp = float(logp_V[token])
                out_ids.append(token)
                logps.append(logp)
                if token in stop:
                    reason = "stop"
                    break
        meta = {"id": body.get("rid"), "finish_reason": {"type": reason}, "completion_tokens": len(out_ids),
                "weight_version": self.weight_version}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logps, out_ids)]
        return {"output_ids": out_ids, "meta_info": meta}

    def _load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        with self.lock, torch.no_grad():
            for name, tensor in named:
                if name not in targets:
                    raise ValueError(f"unknown parameter {name!r}")
                targets[name].copy_(tensor)

    def update_from_tensor(self, body: dict) -> dict:
        raw = base64.b64decode(body["serialized_named_tensors"][0], validate=True)
        self._load(_TensorUnpickler(io.BytesIO(raw)).load())
        return self._updated(body)

    def init_group(self, body: dict) -> dict:
        address = f"{body['master_address']}:{body['master_port']}"
        self.groups[body["group_name"]] = join_weight_group(body.get("backend", "nccl"), address, body["world_size"],
                                                            body["rank_offset"], body["group_name"], 60.0)
        return {"success": True, "message": "joined"}

    def update_from_distributed(self, body: dict) -> dict:
        group = self.groups[body["group_name"]]
        named = []
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            torch.distributed.broadcast(tensor, src=0, group=group)
            named.append((name, tensor))
        self._load(named)
        return self._updated(body)

    def _updated(self, body: dict) -> dict:
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return {"success": True, "message": "Succeeded to update model weights."}


def make_handler(state: FakeSGLang):
    routes = {
        "/generate": state.generate,
        "/update_weights_from_tensor": state.update_from_tensor,
        "/init_weights_update_group": state.init_group,
        "/update_weights_from_distributed": state.update_from_distributed,
        "/release_memory_occupation": lambda body: setattr(state, "released", True),
        "/resume_memory_occupation": lambda body: setattr(state, "released", False),
        "/get_weight_version": lambda body: {"weight_version": state.weight_version},
    }

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep test output quiet
            pass

        def _reply(self, status: int, payload) -> None:
            data = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):  # noqa: N802 (http.server's naming)
            route = routes.get(self.path.split("?")[0])
            if route is None:
                return self._reply(404, {"error": f"no route {self.path}"})
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            try:
                self._reply(200, route(body))
            except Exception as exc:  # the HTTP error IS the report, as SGLang does with success=false
                self._reply(400, {"success": False, "message": f"{type(exc).__name__}: {exc}"})

        do_GET = do_POST

    return Handler


def main(model_path: str) -> None:
    key = os.environ.get("STREAMRFT_FAKE_SGLANG_AUTHKEY")
    if key:
        multiprocessing.current_process().authkey = bytes.fromhex(key)
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(FakeSGLang(model_path)))
    print(f"PORT {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
