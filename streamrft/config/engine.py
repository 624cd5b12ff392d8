from __future__ import annotations

from typing import Literal, Union

from streamrft.config.base import Section


class EngineConfig(Section):
    type: Literal["hf", "vllm", "sglang"] = "hf"  # rollout engine
    temperature: float = 1.0  # sampling temperature (> 0)
    top_p: float = 1.0  # nucleus sampling mass in (0, 1]
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 32  # response length cap; hitting it gives finish_reason="length"
    stop_token_ids: list[int] = []  # extra stop tokens besides the tokenizer's EOS
    first_token_temperature: float = 0.0  # FIRE sampling: temperature of the first token; 0 = off (hf only)
    max_batch_size: int = 256  # sequences decoded together (hf: per chunk; vllm in process: max_num_seqs)
    address: str = ""  # remote vllm / sglang server URL, e.g. http://127.0.0.1:30000; "" = in process (vllm)
    ignore_eos: bool = False  # the tokenizer's EOS does not end a sequence (stop_token_ids still do); benchmarks
    static_cache: bool = False  # hf: preallocated KV cache + on-device sampling (engines/hf_fast.py); GPU speed
    cuda_graphs: bool = False  # hf: replay each decode step from a CUDA graph; needs static_cache and CUDA
    sync_every: int = 16  # hf static_cache: decode steps between host checks for finished rows
    decode_kernels: Literal["auto", "torch", "triton"] = "auto"  # hf static_cache: fused decode ops; auto = Triton on CUDA when installed
    # a child process compiles the static-cache decode path's Triton kernels on a one-layer copy of the model while
    # the run starts (every batch and prompt-length variant a chunk can launch), into Triton's cache (compile_cache_dir)
    # so the first rollout loads them instead of compiling (engines/kernel_warmup.py). auto = on where that path runs
    # Triton kernels on a GPU (engine.type=hf, static_cache=true, decode_kernels auto or triton); true = the same,
    # an error where it would not run
    kernel_warmup: Union[Literal["auto"], bool] = "auto"
    sleep_level: int = 1  # 1 = free KV cache; 2 = also release weights (vllm / sglang)
    request_timeout_s: float = 600.0  # remote vllm / sglang: seconds one HTTP call may take
    tensor_parallel_size: int = 1  # vllm in process: GPUs per engine (one engine per tensor-parallel group)
    gpu_memory_utilization: float = 0.4  # vllm in process: fraction of GPU memory for weights + KV cache
    kv_cache_memory_bytes: int = 0  # vllm in process: KV cache size in bytes; 0 = derive it (CPU: vLLM's default)
    max_model_len: int = 0  # vllm in process: context length; 0 = the model's max_position_embeddings
    enforce_eager: bool = True  # vllm in process: no torch.compile / CUDA graphs (fast start; false = faster decode)
    weight_sync: Literal["tensor", "distributed"] = "tensor"  # sglang: update_weights_from_tensor (same node) or _from_distributed (broadcast group)
    weight_group_address: str = "127.0.0.1:29600"  # sglang distributed weight sync: host:port the trainer (rank 0) listens on
    weight_group_backend: Literal["nccl", "gloo"] = "nccl"  # sglang distributed weight sync: torch.distributed backend
    weight_group_server_ranks: int = 1  # sglang distributed weight sync: the server's tp_size (ranks besides the trainer)


def kernel_warmup_enabled(cfg: EngineConfig, device_type: str) -> bool:
    """engine.kernel_warmup resolved for an engine on ``device_type``: only where the hf engine's static-cache path
    runs its Triton kernels (engines/hf_fast.decode_kernels; a missing triton package is the child's to report)."""
    triton_path = (cfg.type == "hf" and cfg.static_cache and cfg.decode_kernels in ("auto", "triton")
                   and device_type == "cuda")
    return triton_path and cfg.kernel_warmup in ("auto", True)
