"""Peak memory per phase (rollout, train) with and without learner offload, per strategy.

Each configuration runs in a fresh process (peak RSS cannot be reset) at world size 1: build the
strategy on a locally built Qwen2, then repeat [train: forward_backward + step] → offload → [rollout:
unshard, greedy decode with the learner's own modules, reshard] → reload. A sampler thread reads VmRSS
from /proc/self/status every 2 ms; a phase's peak is the largest sample while it runs (on CUDA also
torch.cuda.max_memory_allocated, reset per phase). ``ratio`` is the offload run's peak over the plain
run's peak in the same phase.

On CPU, FSDP2/DeepSpeed offload moves state "to the CPU" it is already on, so the ratios there are ~1.0
by construction: the CPU numbers measure the harness and the phases' own footprint; the ratios are
meaningful on a GPU.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory_offload.py [--hidden 256] [--layers 4] [--strategies fsdp2,deepspeed]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class PhasePeaks:
    """Samples RSS in a thread; ``phase(name)`` records the peak while the block runs."""

    def __init__(self, period_s: float = 0.002):
        self.peaks: dict[str, dict[str, float]] = {}
        self._current, self._max = 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        self._thread.start()

    def _run(self, period_s):
        while not self._stop.is_set():
            self._max = max(self._max, rss_bytes())
            time.sleep(period_s)

    def phase(self, name: str):
        peaks = self

        class _Ctx:
            def __enter__(self):
                peaks._max = rss_bytes()
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()

            def __exit__(self, *exc):
                peaks._max = max(peaks._max, rss_bytes())
                entry = peaks.peaks.setdefault(name, {"rss": 0.0, "cuda": 0.0})
                entry["rss"] = max(entry["rss"], peaks._max)
                if torch.cuda.is_available():
                    entry["cuda"] = max(entry["cuda"], torch.cuda.max_memory_allocated())

        return _Ctx()

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)


def child(model_dir: str, strategy: str, offload: bool, rounds: int, out: str) -> None:
    from streamrft.config.model import ModelConfig
    from streamrft.config.train import TrainConfig
    from streamrft.learner import build_strategy
    from streamrft.learner.microbatch import SequenceSample, make_microbatches
    from streamrft.runtime.distributed import destroy_distributed, init_distributed

    dist = init_distributed(timeout_s=120)
    strat = build_strategy(ModelConfig(path=model_dir), TrainConfig(strategy=strategy, zero_stage=3, lr=1e-4),
                           dist, total_steps=rounds)
    g = torch.Generator().manual_seed(0)
    samples = [SequenceSample(torch.randint(3, 30, (16,), generator=g).tolist(),
                              torch.randint(3, 30, (48,), generator=g).tolist(),
                              {"adv": torch.randn(48, generator=g)}) for _ in range(16)]
    mbs = make_microbatches(samples, token_budget=512)
    n_tokens = float(48 * len(samples))

    def loss_fn(mb, logp_BL, entropy_BL):
        return -(logp_BL * mb["adv"] * mb["response_mask"]).sum() / n_tokens, {}

    peaks = PhasePeaks()
    for _ in range(rounds):
        with peaks.phase("train"):
            for mb in mbs:
                strat.forward_backward(mb, loss_fn, 1.0)
            strat.step()
        if offload:
            strat.offload()
        with peaks.phase("rollout"):
            strat.unshard_for_rollout()
            with torch.no_grad():
                ids = torch.randint(3, 30, (8, 16), generator=g).to(strat.device)
                strat.module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=48,
                                      do_sample=False, use_cache=True, pad_token_id=0)
            strat.reshard_after_rollout()
        if offload:
            strat.reload()
    peaks.close()
    with open(out, "w") as f:
        json.dump(peaks.peaks, f)
    destroy_distributed()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--strategies", default="fsdp2,deepspeed")
    ap.add_argument("--child", nargs=4, metavar=("MODEL", "STRATEGY", "OFFLOAD", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        model, strategy, offload, out = args.child
        child(model, strategy, offload == "1", args.rounds, out)
        return

    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        tok = build_char_tokenizer(model_dir, "0123456789+-=abcdefghijklmnopq")
        build_tiny_qwen2(model_dir, tok, hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                         num_kv_heads=2, intermediate_size=4 * args.hidden, max_position_embeddings=256)
        results = {}
        for strategy in args.strategies.split(","):
            for offload in (False, True):
                out = os.path.join(tmp, f"{strategy}_{int(offload)}.json")
                cmd = [sys.executable, __file__, "--rounds", str(args.rounds),
                       "--child", model_dir, strategy, str(int(offload)), out]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if proc.returncode != 0:
                    print(f"{strategy} offload={offload} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                    continue
                results[(strategy, offload)] = json.load(open(out))
    mib = 1 << 20
    print(f"device: {'cuda' if torch.cuda.is_available() else 'cpu'}; model hidden={args.hidden} layers={args.layers}")
    print(f"{'strategy':<10} {'phase':<8} {'RSS plain MiB':>14} {'RSS offload MiB':>16} {'ratio':>6}"
          f" {'CUDA plain MiB':>15} {'CUDA offload MiB':>17} {'ratio':>6}")
    for strategy in args.strategies.split(","):
        plain, off = results.get((strategy, False)), results.get((strategy, True))
        if plain is None or off is None:
            continue
        for phase in ("rollout", "train"):
            a, b = plain[phase], off[phase]
            cuda_ratio = f"{b['cuda'] / a['cuda']:6.2f}" if a["cuda"] else f"{'-':>6}"
            print(f"{strategy:<10} {phase:<8} {a['rss'] / mib:14.1f} {b['rss'] / mib:16.1f} {b['rss'] / a['rss']:6.2f}"
                  f" {a['cuda'] / mib:15.1f} {b['cuda'] / mib:17.1f} {cuda_ratio}")


if __name__ == "__main__":
    main()
