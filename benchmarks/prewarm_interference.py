"""How much the checkpoint stager's background prewarm slows the training thread, and which part of it.

After the first train step the Checkpointer prewarms the host buffers of the first save in a thread
(checkpoint/staging.py: one HostSlab, its pages first touched, then page-locked chunk by chunk). In the GRPO
benchmark the two train steps after that ran ~1 s slower each, with the same GPU kernel time: the training
thread itself was slowed. This runs a launch-bound CUDA loop on the main thread (small matmuls, a sync every
iteration, like a host-bound learner) alone, then beside each part of the prewarm in a thread:

* ``slab``: the real HostSlab (touch + page-lock);
* ``touch-torch``: only the first touch, as HostSlab does it (``zero_()`` on intra-op threads);
* ``touch-1thread``: the first touch by one thread (ctypes.memset);
* ``lock``: only the page-locking of already touched memory (cudaHostRegister in CHUNK_BYTES chunks).

It prints each one's main-loop iterations per second against the loop alone (ratio < 1: the training thread
was slowed) and how long the background part took.

    python benchmarks/prewarm_interference.py --gib 6
"""

from __future__ import annotations

import argparse
import ctypes
import threading
import time

import torch

from streamrft.checkpoint.pinning import CHUNK_BYTES, PAGE, HostSlab, cuda_register, cuda_unregister


def main_loop_rate(stop: threading.Event, min_s: float) -> float:
    """Iterations per second of a launch-bound loop until ``stop`` is set (and at least ``min_s``)."""
    a = torch.randn(256, 256, device="cuda")
    n, t0 = 0, time.perf_counter()
    while not stop.is_set() or time.perf_counter() - t0 < min_s:
        x = a
        for _ in range(20):
            x = x @ a
            x = x * 0.01
        torch.cuda.synchronize()
        n += 1
    return n / (time.perf_counter() - t0)


def touch_torch(nbytes: int) -> None:
    torch.empty(nbytes, dtype=torch.uint8).zero_()


def touch_one_thread(nbytes: int) -> None:
    buf = torch.empty(nbytes, dtype=torch.uint8)
    ctypes.memset(buf.data_ptr(), 0, nbytes)


def lock_only(buf: torch.Tensor) -> None:
    base = -(-buf.data_ptr() // PAGE) * PAGE
    n = (buf.numel() - PAGE) // PAGE * PAGE
    done = []
    for off in range(0, n, CHUNK_BYTES):
        size = min(CHUNK_BYTES, n - off)
        if cuda_register(base + off, size) is None:
            done.append(base + off)
    for addr in done:
        cuda_unregister(addr)


def slab(nbytes: int) -> None:
    n = nbytes // 4
    specs = [(torch.Size([n // 64]), torch.float32)] * 64
    HostSlab(specs, pin=True)


def run(name: str, fn, base_rate: float) -> None:
    stop = threading.Event()
    took = {}

    def bg():
        t0 = time.perf_counter()
        fn()
        took["s"] = time.perf_counter() - t0
        stop.set()

    t = threading.Thread(target=bg, daemon=True)
    t.start()
    rate = main_loop_rate(stop, 0.5)
    t.join()
    print(f"{name:14} background {took['s']:6.2f} s   main loop {rate:8.1f} it/s = {rate / base_rate:5.2f}x alone",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=6.0, help="host bytes prewarmed (0.5B: ~6, 1.5B: ~18.5)")
    a = ap.parse_args()
    nbytes = int(a.gib * 2**30)
    idle = threading.Event()
    idle.set()
    main_loop_rate(idle, 1.0)  # warm-up
    base = main_loop_rate(idle, 3.0)
    print(f"main loop alone: {base:.1f} it/s; threads: torch intra-op {torch.get_num_threads()}", flush=True)
    touched = torch.zeros(nbytes + PAGE, dtype=torch.uint8)
    run("lock", lambda: lock_only(touched), base)
    del touched
    run("touch-1thread", lambda: touch_one_thread(nbytes), base)
    run("touch-torch", lambda: touch_torch(nbytes), base)
    run("slab", lambda: slab(nbytes), base)
    print(f"main loop alone again: {main_loop_rate(idle, 3.0) / base:.2f}x the first", flush=True)


if __name__ == "__main__":
    main()
