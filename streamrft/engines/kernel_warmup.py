"""The engine's kernel warm-up (``engine.kernel_warmup``): a child process compiles the static-cache decode path's
Triton kernels while the run starts, so the first rollout loads them from Triton's cache.

Why: a cold first rollout pays Triton compiling the decode kernels (0.5B on an H200: 9.48 s cold against 3.03 s with
warm caches, benchmarks/NOTES.md v12), and the rollout is what the run's first ~16 s of imports, config checks and
model load lead up to. Triton compiles a kernel at its first launch with a new specialisation and keeps it on disk
(``TRITON_CACHE_DIR``; ``compile_cache_dir`` sets it) under a key of its source, its compile-time constants, its
arguments' dtypes, each integer argument's divisibility by 16 (and equality to 1), each pointer's 16-byte alignment
and the GPU's architecture. A model of the run's configuration with one decoder layer, decoded through the engine's
own ``StaticDecoder`` in the run's dtype and sampling settings, launches the kernels with the run's keys: every
decoder layer's launches are alike, and what differs from the run (the number of layers, the weights, the rows'
tokens, the cache's length) is in no key.

What does vary within a run, and is warmed one variant each (``launch_variants``):
- the batch (a chunk's rows, a compacted long tail's, a merged chunk's in the async placement) picks the sampler's
  vocabulary split (``race_splits``) and the attention's context split (``attention_splits``), both compile-time
  constants: one batch size per distinct pair, the run's likeliest chunk first, then from the largest down (a long
  tail's compactions go down);
- the prompt length, an integer argument of the attention kernel: one length divisible by 16 and one not.

The child starts at the run's launch (``learner/compile_warmup.start_compile_warmup``, from local rank 0: the cache is
the node's), and nothing waits for it: a kernel the run needs before the child has compiled it, the run compiles
itself (Triton writes its cache atomically, so both copies are whole). A child that fails costs one warning with its
log's tail, never the run; it is killed when the run ends. While it runs it holds the one-layer copy, one step's
logits and a two-token cache on the rank's device (~1 GiB at 0.5B, ~3 GiB at 7B with its CUDA context).
"""

from __future__ import annotations

import os
import sys
import time

PROMPT_LENGTHS = (16, 17)  # one divisible by 16, one not: the attention kernel's prompt-length argument's two keys


def launch_variants(first: int, largest: int, vocab: int, n_kv: int, multiprocessor_count: int) -> list[int]:
    """One batch size per distinct (sampler split, attention split) pair that a chunk of 1..``largest`` rows can
    launch: ``first`` (the run's likeliest chunk) first, then the others from the largest down."""
    from streamrft.engines.triton_decode import attention_splits, race_splits

    sizes, seen = [], set()
    for batch in (min(first, largest), *range(largest, 0, -1)):
        key = (race_splits(batch, vocab)[0], attention_splits(batch, n_kv, multiprocessor_count))
        if key not in seen:
            seen.add(key)
            sizes.append(batch)
    return sizes


def likeliest_chunk(cfg, world_size: int) -> int:
    """Rows of the run's first chunk: a rank's share of a step's samples (an engine process's in the async
    placement), at most ``engine.max_batch_size``."""
    r = cfg.rollout
    ranks = r.engine_ranks if r.placement == "async" else world_size
    return max(1, min(cfg.engine.max_batch_size, r.prompts_per_step // max(1, ranks) * r.n_samples_per_prompt))


def warm_decode_kernels(module, engine_cfg, device, first: int, multiprocessor_count: int | None = None) -> int:
    """Decode one step of every launch variant (module docstring) on ``module`` with the Triton kernels; returns the
    number of variants. ``module``: a decoder the static path supports, on ``device``, in the run's dtype."""
    import torch

    from streamrft.engines import triton_decode
    from streamrft.engines.hf_fast import StaticDecoder

    config = module.config
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if multiprocessor_count is None:
        multiprocessor_count = triton_decode.multiprocessors(torch.device(device))
    sizes = launch_variants(first, engine_cfg.max_batch_size, config.vocab_size, n_kv, multiprocessor_count)
    launches = 0
    with torch.no_grad():
        for batch in sizes:
            for prompt_len in PROMPT_LENGTHS:
                # one prompt shared by every row (prefill runs it once); two new tokens: prefill's and one step's
                dec = StaticDecoder(module, [[1] * prompt_len] * batch, list(range(batch)), 2, 0, [],
                                    engine_cfg.temperature, engine_cfg.first_token_temperature, engine_cfg.top_k,
                                    engine_cfg.top_p, torch.device(device), triton_decode)
                dec.prefill()
                dec.run_steps(1)
                if torch.device(device).type == "cuda":
                    torch.cuda.synchronize(device)  # a failing kernel fails here, naming itself
                launches += 1
    return launches


def warm(cfg, device_type: str, world_size: int, cuda_preinit=None) -> dict:
    """The child's work: check that the run's engine launches Triton kernels, build the one-layer copy, warm.
    ``cuda_preinit``: the CUDA context its ``main`` began beside the imports (learner/compile_warmup.py
    ``start_cuda_preinit``), waited for here and reported."""
    import importlib.util

    import torch

    from streamrft.compile_cache import apply_compile_cache
    from streamrft.engines.hf_fast import check_static_support
    from streamrft.learner.compile_warmup import _since_interpreter_start, one_layer_model

    phases = {"imports_s": _since_interpreter_start()}
    preinit = cuda_preinit.wait().report() if cuda_preinit is not None else {}
    if device_type == "cuda" and not torch.cuda.is_available():
        return {"status": "skipped", "reason": "this torch finds no CUDA device; the engine decodes on what it finds",
                **preinit}
    if importlib.util.find_spec("triton") is None:
        return {"status": "skipped", "reason": "the triton package is not installed (the engine decodes with the "
                "torch ops: engine.decode_kernels=auto)"}
    apply_compile_cache(cfg.compile_cache_dir)  # as compose.build_run and the engine processes, before any compile
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if device_type == "cuda" else "cpu"
    t = time.perf_counter()
    model = one_layer_model(cfg.model, device)
    if model is None:
        return {"status": "skipped", "reason": "a multimodal model.path (the static path decodes text models)"}
    try:
        check_static_support(model)
    except ValueError as exc:  # the run's engine says so itself when it is built
        return {"status": "skipped", "reason": str(exc)}
    model.to(device).eval()
    phases["model_s"] = time.perf_counter() - t
    t = time.perf_counter()
    launches = warm_decode_kernels(model, cfg.engine, device, likeliest_chunk(cfg, world_size))
    return {"status": "ok", "launches": launches, "seconds": round(time.perf_counter() - t, 3),
            **{k: round(v, 3) for k, v in phases.items()}, **preinit}


def main(argv: list[str]) -> int:
    from streamrft.learner.compile_warmup import run_child, start_cuda_preinit
    from streamrft.parent_death import die_with_parent

    die_with_parent()  # a run that dies (even by SIGKILL) takes its warm-up child with it
    preinit = start_cuda_preinit(argv)  # first: the CUDA context is made beside the imports
    return run_child(argv, lambda cfg, device_type, _result_path, world_size: warm(cfg, device_type, int(world_size),
                                                                                  preinit))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
