"""How long a background host-buffer allocation holds up the training thread's CUDA calls (GPU only).

    python benchmarks/pin_stall.py [--gib 6] [--tensors 290] [--out DIR]

The checkpoint stager allocates its host buffers in a background thread after the first train step (v11 in
benchmarks/NOTES.md). Each variant runs in a fresh process (PyTorch caches pinned blocks): a background
thread allocates ``--gib`` of host buffers in ``--tensors`` tensors while the main thread runs a loop of
small kernels, each followed by a synchronize, for as long as the allocation takes (at least 2 s); the
main thread's worst gap between two iterations and its total loop time are compared with the same loop
and no allocation (``none``, measured in the same run).

- ``cudahostalloc``: ``torch.empty(..., pin_memory=True)`` per tensor (the stager before v11);
- ``slab``: one ``HostSlab`` (streamrft/checkpoint/pinning.py): touched without CUDA, page-locked in 256 MiB
  chunks with cudaHostRegister;
- ``pageable``: the same slab not page-locked (what remains if the driver refuses): its first touch only,
  a ``zero_()`` on PyTorch's intra-op threads;
- ``touch-1thread``: that first touch by one thread (``ctypes.memset``), nothing locked;
- ``lock``: only the page-locking, of memory touched before the loop starts (cudaHostRegister in the
  slab's chunks): the part that holds the CUDA driver's lock.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

VARIANTS = ("none", "cudahostalloc", "slab", "pageable", "touch-1thread", "lock")


def run_variant(variant: str, gib: float, tensors: int) -> dict:
    import torch

    from streamrft.checkpoint.pinning import CHUNK_BYTES, PAGE, HostSlab, cuda_register, cuda_unregister

    if not torch.cuda.is_available():
        raise SystemExit("pin_stall.py measures CUDA driver contention: it needs a GPU")
    x = torch.zeros(1 << 16, device="cuda")
    for _ in range(50):  # warm: context, kernels
        x.add_(1)
    torch.cuda.synchronize()
    numel = int(gib * (1 << 30) / 4 / tensors)
    specs = [(torch.Size([numel]), torch.float32)] * tensors
    alloc_s: list[float] = []
    nbytes = numel * 4 * tensors
    touched = torch.zeros(nbytes + PAGE, dtype=torch.uint8) if variant == "lock" else None

    def allocate() -> None:
        started = time.perf_counter()
        if variant == "cudahostalloc":
            kept = [torch.empty(shape, dtype=dtype, pin_memory=True) for shape, dtype in specs]
        elif variant in ("slab", "pageable"):
            kept = HostSlab(specs, pin=variant == "slab")
        elif variant == "touch-1thread":
            kept = torch.empty(nbytes, dtype=torch.uint8)
            ctypes.memset(kept.data_ptr(), 0, nbytes)
        else:  # lock
            base = -(-touched.data_ptr() // PAGE) * PAGE
            kept = [base + off for off in range(0, nbytes // PAGE * PAGE, CHUNK_BYTES)
                    if cuda_register(base + off, min(CHUNK_BYTES, nbytes // PAGE * PAGE - off)) is None]
        alloc_s.append(time.perf_counter() - started)
        if variant == "lock":
            for address in kept:
                cuda_unregister(address)
        del kept

    worker = threading.Thread(target=allocate) if variant != "none" else None
    gaps, started = [], time.perf_counter()
    if worker is not None:
        worker.start()
    last = started
    while (worker is not None and worker.is_alive()) or time.perf_counter() - started < 2.0:
        x.add_(1)
        torch.cuda.synchronize()
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    if worker is not None:
        worker.join()
    return {"variant": variant, "gib": gib, "tensors": tensors, "alloc_s": alloc_s[0] if alloc_s else 0.0,
            "loop_s": last - started, "iterations": len(gaps), "worst_gap_s": max(gaps),
            "median_gap_s": sorted(gaps)[len(gaps) // 2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=6.0, help="host buffers to allocate (0.5B's fp32 state: ~6)")
    ap.add_argument("--tensors", type=int, default=290, help="how many tensors they are split into")
    ap.add_argument("--out", type=Path, default=None, help="write results.json here")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in this process
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.gib, args.tensors)))
        return
    rows = []
    for variant in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, "--variant", variant, "--gib", str(args.gib),
                               "--tensors", str(args.tensors)], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"pin_stall.py: variant {variant} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    base = rows[0]
    print(f"{'variant':<14} {'alloc_s':>8} {'worst_gap_s':>12} {'median_gap_ms':>14} {'loop_iters/s':>13} "
          f"{'iters/s vs none':>16}")
    for r in rows:
        rate = r["iterations"] / r["loop_s"]
        print(f"{r['variant']:<14} {r['alloc_s']:>8.2f} {r['worst_gap_s']:>12.3f} {1e3 * r['median_gap_s']:>14.3f} "
              f"{rate:>13.0f} {rate / (base['iterations'] / base['loop_s']):>15.2f}x")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
