"""Overhead of observability on a real CPU arith run: Prometheus exporter + JSONL/Parquet sinks +
TensorBoard on vs. all off, same seed, alternating runs in one invocation (less drift between arms).

    python benchmarks/observability_overhead.py --arith-dir runs/arith --steps 12 --pairs 3

Time per step = the sum of steps.jsonl's step_seconds / steps (the train loop only; model load and
held-out evaluation excluded). Prints both medians and their ratio (target <= 1.03).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.ports import free_port  # noqa: E402 - a port below the ephemeral range: no other socket takes it first


def seconds_per_step(arith_dir: Path, steps: int, observed: bool, workdir: Path) -> float:
    out = Path(tempfile.mkdtemp(dir=workdir))
    overrides = [
        f"model.path={arith_dir / 'sft'}", f"data.train_path={arith_dir / 'train.jsonl'}",
        f"data.eval_path={arith_dir / 'eval.jsonl'}", "data.eval_size=8", f"output_dir={out}",
        "rollout.prompts_per_step=8", "rollout.n_samples_per_prompt=4", f"train.max_steps={steps}", "seed=0",
    ]
    if observed:
        overrides += [f"metrics.port={free_port()}", "metrics.tensorboard=true",
                      f"sinks.jsonl={out / 'jsonl'}", f"sinks.parquet={out / 'parquet'}"]
    subprocess.run([sys.executable, "-m", "streamrft.cli", "train", str(REPO / "pipelines/arith/config.yaml"), *overrides],
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return sum(r["step_seconds"] for r in rows) / len(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arith-dir", type=Path, required=True, help="output of pipelines/arith/prepare.py")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--pairs", type=int, default=3, help="alternating (off, on) run pairs")
    args = parser.parse_args()
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as workdir:
        for i in range(args.pairs):
            for observed in ((False, True) if i % 2 == 0 else (True, False)):
                times[observed].append(seconds_per_step(args.arith_dir, args.steps, observed, Path(workdir)))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"off: {off * 1e3:.1f} ms/step  runs={[round(t * 1e3, 1) for t in times[False]]}")
    print(f"on:  {on * 1e3:.1f} ms/step  runs={[round(t * 1e3, 1) for t in times[True]]}  (exporter + jsonl + parquet + tensorboard)")
    print(f"ratio on/off: {on / off:.3f} (target <= 1.03)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
