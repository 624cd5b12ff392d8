"""Is reward latency hidden? The CPU arith run scored by a real reward service that answers at once,
then by one that sleeps 100 ms per request; prints the time-per-step ratio (target: <= 1.10).

    python benchmarks/reward_latency.py [--steps 8] [--prompts 64]

Scoring overlaps generation: each sample is scored as soon as its own generation ends, and the
engine decodes in chunks of engine.max_batch_size, so only the last chunk's scoring is exposed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.ports import free_port  # noqa: E402 - a port below the ephemeral range: no other socket takes it first


def start_service(fn: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrft.rewards.service", "--fn", fn, "--bind", f"tcp://127.0.0.1:{port}", "--workers", "128"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    for line in proc.stdout:
        if "serve-reward: ready" in line:
            return proc
    raise RuntimeError(f"service {fn} did not start")


def run(arith: dict, fn: str, steps: int, prompts: int, out: Path) -> float:
    from streamrft.config import load_config
    from streamrft.compose import train

    port = free_port()
    service = start_service(fn, port)
    try:
        cfg = load_config(ROOT / "pipelines/arith/config.yaml", [
            f"model.path={arith['model_dir']}", f"data.train_path={arith['train_path']}", "data.eval_path=",
            f"output_dir={out}", f"train.max_steps={steps}", f"rollout.prompts_per_step={prompts}",
            "engine.max_batch_size=64", "reward.max_concurrency=128", "checkpoint.resume=false",
            f"reward.sources=[{{name: exact, type: remote, address: 'tcp://127.0.0.1:{port}'}}]",
        ])
        train(cfg)
    finally:
        service.terminate()
        service.wait(30)
    times = [json.loads(line)["step_seconds"] for line in (out / "steps.jsonl").read_text().splitlines()]
    return sum(times[1:]) / max(len(times) - 1, 1)  # the first step warms caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=64)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "pipelines" / "arith"))
    from prepare import prepare

    with tempfile.TemporaryDirectory() as tmp:
        arith = prepare(str(Path(tmp) / "arith"), warmup_steps=300, n_train=2000, n_eval=64)
        instant = run(arith, "benchmarks/slow_reward.py:arith_instant", args.steps, args.prompts, Path(tmp) / "instant")
        slow = run(arith, "benchmarks/slow_reward.py:arith_slow", args.steps, args.prompts, Path(tmp) / "slow")
    print(f"reward latency: instant service {instant:.3f} s/step, 100 ms service {slow:.3f} s/step, "
          f"ratio {slow / instant:.3f} (target <= 1.10)")


if __name__ == "__main__":
    main()
