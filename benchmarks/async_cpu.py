"""Colocated vs async placement on CPU, same arith workload, one invocation; prints the ratio.

    python benchmarks/async_cpu.py [--steps 60] [--learners 1] [--out /tmp/async_cpu]

Builds the arith fixture model (700 warm-up steps) once, then runs `streamrft train` with
rollout.placement=colocated and =async (staleness 1 both, decode chunks of 16 rows), and prints wall
seconds per run, the async/colocated throughput ratio, held-out accuracy of both, and the async run's
busy fractions (engine, learner, both). CPU numbers: the two processes share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--learners", type=int, default=1)
    ap.add_argument("--out", default="/tmp/async_cpu")
    a = ap.parse_args()
    out = Path(a.out)
    sys.path.insert(0, str(ROOT / "pipelines" / "arith"))
    from prepare import prepare

    model = out / "model"
    prepare(str(model), seed=0, warmup_steps=700, n_train=600, n_eval=64)
    common = [f"model.path={model / 'sft'}", f"data.train_path={model / 'train.jsonl'}",
              f"data.eval_path={model / 'eval.jsonl'}", "data.eval_size=64", "metrics.progress=false",
              "rollout.n_samples_per_prompt=8", "rollout.prompts_per_step=32", "rollout.max_staleness=1",
              "engine.max_batch_size=16", f"train.max_steps={a.steps}", "checkpoint.save_every=0"]
    results = {}
    for placement in ("colocated", "async"):
        run_dir = out / placement
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        args = [str(ROOT / "pipelines" / "arith" / "config.yaml"), *common, f"output_dir={run_dir}",
                f"rollout.placement={placement}", "checkpoint.resume=never"]
        if a.learners == 1:
            cmd = [sys.executable, "-m", "streamrft.cli", "train", *args]
        else:
            cmd = [str(ROOT / "launch" / "colocate.sh"), *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", NPROC_PER_NODE=str(a.learners))
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(proc.stdout[-2000:] + proc.stderr[-2000:])
        summary = json.loads(proc.stdout.split("summary: ", 1)[1].splitlines()[0])
        rows = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
        results[placement] = {"wall_s": wall, "train_loop_s": summary["seconds"],
                              "step_s_sum": sum(r["step_seconds"] for r in rows), **summary}
    c, s = results["colocated"], results["async"]
    print(f"steps={a.steps} learners={a.learners} prompts=32x8")
    for name, r in results.items():
        print(f"{name:9} train loop {r['train_loop_s']:.1f} s  heldout {r['heldout_accuracy_before']:.3f} -> "
              f"{r['heldout_accuracy_after']:.3f}")
    print(f"async/colocated throughput (train loop seconds): {c['train_loop_s'] / s['train_loop_s']:.2f}x")
    print(f"async busy fractions: engine {s.get('async_engine_busy_fraction', 0):.2f}, learner "
          f"{s.get('async_learner_busy_fraction', 0):.2f}, both {s.get('async_both_busy_fraction', 0):.2f}")


if __name__ == "__main__":
    main()
