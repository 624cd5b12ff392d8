"""The first train step with and without ``compiling.preload_compiler`` (Inductor imported in a background thread
once the learner is built), measured in one invocation: the arith pipeline with compiled decoder layers on a warm
compile cache, runs alternating between the two (each a fresh process), so drift on a shared machine hits both.

    python benchmarks/preload_bench.py --out /tmp/pb                      # async placement (an engine process)
    python benchmarks/preload_bench.py --out /tmp/pb --placement colocated

The preload helps where the learner's main thread waits while the first rollout is made (a GPU's CUDA work, an
engine process); colocated on a CPU the rollout holds the interpreter and nothing overlaps. Prints each run's
first-step seconds and wall seconds and the with/without ratios of their medians; writes result.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("preload", "none")


def worker(mode: str, train_args: list[str]) -> None:
    """``streamrft train`` with the preload as built (``preload``) or turned into a no-op (``none``)."""
    sys.path.insert(0, str(ROOT))
    from streamrft import compose
    from streamrft.cli import main

    if mode == "none":
        compose._preload_compiler_if_used = lambda cfg, dist: None
    sys.argv = ["streamrft", "train", *train_args]
    main()


def train_args(data: Path, out: Path, placement: str) -> list[str]:
    extra = ["rollout.placement=async", "rollout.engine_ranks=1", "rollout.max_staleness=1"] if placement == "async" else []
    return [str(ROOT / "pipelines" / "arith" / "config.yaml"), f"model.path={data / 'sft'}",
            f"data.train_path={data / 'train.jsonl'}", "data.eval_path=", f"output_dir={out}", "metrics.progress=false",
            "train.max_steps=2", "checkpoint.save_every=0", "train.compile_layers=true",
            f"compile_cache_dir={data.parent / 'compile_cache'}", *extra]


def run_once(mode: str, data: Path, out: Path, placement: str, timeout: float) -> dict:
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker", mode, "--", *train_args(data, out, placement)],
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"preload_bench: the {mode} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    first = json.loads((out / "steps.jsonl").read_text().splitlines()[0])
    return {"mode": mode, "step1_s": first["step_seconds"], "compile_s": first.get("compile_seconds", 0.0),
            "wall_s": wall}


def ratios(rows: list[dict]) -> dict[str, float]:
    """preload / none of the median first-step and wall seconds (pure: rows as ``main`` collects them)."""
    def median(mode, key):
        return statistics.median(r[key] for r in rows if r["mode"] == mode)

    return {key: median("preload", key) / median("none", key) for key in ("step1_s", "wall_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the arith model, the compile cache and the runs (required)")
    parser.add_argument("--pairs", type=int, default=3, help="alternating (preload, none) pairs after a warm-up run")
    parser.add_argument("--placement", choices=("async", "colocated"), default="async")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.worker:
        return worker(args.worker, [a for a in rest if a != "--"])
    if not args.out:
        parser.error("--out is required")

    out = Path(args.out)
    data = out / "arith"
    sys.path.insert(0, str(ROOT / "pipelines" / "arith"))
    from prepare import prepare

    prepare(str(data), warmup_steps=0, n_train=600, n_eval=64)  # timing only: the untrained model will do
    run_once("preload", data, out / "warmup", args.placement, args.timeout)  # fills the compile cache
    rows = []
    for _ in range(args.pairs):
        for mode in MODES:
            row = run_once(mode, data, out / f"run-{mode}", args.placement, args.timeout)
            rows.append(row)
            print(f"{mode:8s} step 1 {row['step1_s']:.2f} s (compile {row['compile_s']:.2f} s), "
                  f"run {row['wall_s']:.2f} s", flush=True)
    summary = {"placement": args.placement, "rows": rows, "ratio_preload_over_none": ratios(rows)}
    (out / "result.json").write_text(json.dumps(summary, indent=1))
    print("preload / none (medians):", ", ".join(f"{k} {v:.2f}x" for k, v in summary["ratio_preload_over_none"].items()))


if __name__ == "__main__":
    main()
