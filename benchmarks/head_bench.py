"""LM-head log-prob + entropy, forward + backward: ``train.head_kernel`` fused against checkpoint.

For N response rows of hidden size H and a vocabulary of V (no bias, entropy on, temperature 0.7, upstream
gradients on both outputs), each kernel runs ``--repeats`` forward+backward passes per chunk size; the
table gives the best time (the minimum: on a shared machine other work only adds), the model TFLOP/s
(6 N H V: forward, dh, dW; the recompute matmul is not counted), the peak memory above the inputs
(gradient buffers included, they are the same for both), and the ratios fused / checkpoint, at equal
chunks and at each kernel's default chunk (logprobs.DEFAULT_CHUNK).

Peak memory: on CUDA ``torch.cuda.max_memory_allocated``; on CPU each case runs in a child process with
``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB (every large block is mmapped and given back on free, so the
resident-set high-water mark tracks live tensors), peak = ru_maxrss - the RSS once inputs exist.

CPU (default shape N=2048, H=896, V=32768, float32; a few minutes on one core):

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/head_bench.py

GPU (the real shapes, bf16, train.compile_head on for both kernels; one H200):

    python benchmarks/head_bench.py --device cuda --n 16384 --hidden 896,1536 --vocab 151936 \\
        --dtype bfloat16 --chunks 1024,2048,4096,8192
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamrft.learner.fused_head import fused_logp_entropy  # noqa: E402
from streamrft.learner.logprobs import DEFAULT_CHUNK, _checkpointed_chunks  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
T = 0.7


def _inputs(n: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device):
    g = torch.Generator(device).manual_seed(0)
    h = (torch.randn(n, hidden, device=device, generator=g) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=g) * hidden ** -0.5).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (n,), device=device, generator=g)
    g_logp = torch.randn(n, device=device, generator=g)
    g_ent = torch.randn(n, device=device, generator=g) * 0.01
    return h, w, target, g_logp, g_ent


def _step(kernel: str, chunk: int, h, w, target, g_logp, g_ent, compile_head: bool) -> None:
    """One forward + backward; leaves the gradients in h.grad and w.grad."""
    if kernel == "fused":
        logp, ent = fused_logp_entropy(h, w, None, target, 1.0 / T, True, chunk, None, compile_head)
    else:
        logps, ents = _checkpointed_chunks(h, w, None, target, 1.0 / T, True, chunk, None, compile_head)
        logp, ent = torch.cat(logps), torch.cat(ents)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_case(kernel: str, chunk: int, args) -> dict:
    """Time and peak memory of one kernel at one chunk size, in this process."""
    device = torch.device(args.device)
    h, w, target, g_logp, g_ent = _inputs(args.n, args.hidden_one, args.vocab, DTYPES[args.dtype], device)
    compile_head = device.type == "cuda" and not args.no_compile
    times = []
    if device.type == "cuda":
        _step(kernel, chunk, h, w, target, g_logp, g_ent, compile_head)  # compile + allocator warm-up
        h.grad = w.grad = None
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = _rss_bytes()
    for i in range(args.repeats):
        h.grad = w.grad = None
        _sync(device)
        t0 = time.perf_counter()
        _step(kernel, chunk, h, w, target, g_logp, g_ent, compile_head)
        _sync(device)
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"kernel": kernel, "chunk": chunk, "time_s": min(times), "peak_bytes": peak,
            "w_grad_sum": float(w.grad.float().abs().sum()), "h_grad_sum": float(h.grad.float().abs().sum())}


def run_case_isolated(kernel: str, chunk: int, args) -> dict:
    """run_case in a child process (CPU: its own resident-set high-water mark)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, __file__, "--_one", f"{kernel}:{chunk}", "--device", args.device, "--n", str(args.n),
           "--hidden", str(args.hidden_one), "--vocab", str(args.vocab), "--dtype", args.dtype,
           "--repeats", str(args.repeats)] + (["--no-compile"] if args.no_compile else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"head_bench case {kernel}:{chunk} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--n", type=int, default=2048, help="response rows (tokens) in the microbatch")
    p.add_argument("--hidden", default="896", help="hidden sizes, comma-separated")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--chunks", default="1024,2048,4096", help="rows per chunk, comma-separated (both kernels)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-compile", action="store_true", help="CUDA: train.compile_head=false for both kernels")
    p.add_argument("--_one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._one:
        kernel, chunk = args._one.split(":")
        args.hidden_one = int(args.hidden)
        print(json.dumps(run_case(kernel, int(chunk), args)))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("head_bench: --device cuda but torch.cuda.is_available() is False")
    chunks = sorted({int(c) for c in args.chunks.split(",")} | set(DEFAULT_CHUNK.values()))
    print(f"head_bench: device={args.device} N={args.n} V={args.vocab} dtype={args.dtype} repeats={args.repeats} "
          f"threads={torch.get_num_threads()} default chunks {DEFAULT_CHUNK}")
    for hidden in (int(x) for x in args.hidden.split(",")):
        args.hidden_one = hidden
        flops = 6 * args.n * hidden * args.vocab
        rows = {}
        print(f"\nH={hidden}: model FLOPs {flops / 1e12:.3f} T per forward+backward")
        print("| kernel | chunk | time s | TFLOP/s | peak MiB |")
        print("|---|---|---|---|---|")
        for chunk in chunks:
            for kernel in ("checkpoint", "fused"):
                r = run_case(kernel, chunk, args) if args.device == "cuda" else run_case_isolated(kernel, chunk, args)
                rows[kernel, chunk] = r
                print(f"| {kernel} | {chunk} | {r['time_s']:.4f} | {flops / r['time_s'] / 1e12:.2f} | "
                      f"{r['peak_bytes'] / 2**20:.0f} |", flush=True)
        for chunk in chunks:
            f, c = rows["fused", chunk], rows["checkpoint", chunk]
            print(f"chunk {chunk}: fused/checkpoint time {f['time_s'] / c['time_s']:.3f}, "
                  f"peak {f['peak_bytes'] / c['peak_bytes']:.3f}; "
                  f"|dW| sums {f['w_grad_sum']:.6g} / {c['w_grad_sum']:.6g}")
        f, c = rows["fused", DEFAULT_CHUNK["fused"]], rows["checkpoint", DEFAULT_CHUNK["checkpoint"]]
        print(f"defaults (fused {DEFAULT_CHUNK['fused']}, checkpoint {DEFAULT_CHUNK['checkpoint']}): "
              f"fused/checkpoint time {f['time_s'] / c['time_s']:.3f}, peak {f['peak_bytes'] / c['peak_bytes']:.3f}")


if __name__ == "__main__":
    main()
