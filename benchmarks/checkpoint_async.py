"""What a checkpoint save adds to a train step: synchronous vs checkpoint.async_save, in one invocation.

World size 1, FSDP2 on a locally built Qwen2 (random init), AdamW. Three loops of ``--steps`` train steps
on the same model shape, each with a fresh strategy and output folder:
- ``none``: no saves (the step time without checkpointing);
- ``sync``: a checkpoint after every step, written in the training thread;
- ``async``: the same with checkpoint.async_save=true (host copy in the step, write in the background;
  the loop ends with the wait for the last write, which is counted).
For each: the median time the training thread spends in ``step_done`` (``blocked``), and the added wall
time per step against ``none`` ((loop wall - none's loop wall) / steps; it includes the background
writer's competition for the CPU). The ratio async/sync of the added time is the number to read.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/checkpoint_async.py [--hidden 512] [--layers 8] [--steps 6]
        [--samples 8] [--response 64]

On a CPU the background writer shares the cores with the train step: async wins only when the step is
longer than the write (the next save waits for the previous one). On a GPU the step runs on the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def build(tmp: Path, hidden: int, layers: int) -> str:
    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2

    tok = build_char_tokenizer(str(tmp), "0123456789+-=abc")
    return build_tiny_qwen2(str(tmp), tok, hidden_size=hidden, num_layers=layers, num_heads=8, num_kv_heads=4,
                            intermediate_size=hidden * 3, max_position_embeddings=256)


def loop(model_dir: str, out: Path, mode: str, steps: int, dist, samples: int, response: int) -> dict:
    from streamrft.checkpoint import Checkpointer
    from streamrft.config import Config
    from streamrft.config.checkpoint import CheckpointConfig
    from streamrft.config.model import ModelConfig
    from streamrft.config.train import TrainConfig
    from streamrft.learner.fsdp2 import FSDP2Strategy
    from streamrft.learner.microbatch import SequenceSample, make_microbatches
    from streamrft.runtime.accounting import Accounting

    cfg = Config(output_dir=str(out), seed=0, model=ModelConfig(path=model_dir),
                 train=TrainConfig(max_steps=steps + 1, lr=1e-4),  # no "final" save inside the loop
                 checkpoint=CheckpointConfig(save_every=0 if mode == "none" else 1, keep=2,
                                             async_save=mode == "async"))
    strategy = FSDP2Strategy(cfg.model, cfg.train, dist, total_steps=cfg.train.max_steps)
    ckpt = Checkpointer(cfg, dist, strategy, Accounting())
    ckpt.resume({})
    g = torch.Generator().manual_seed(0)
    batch = [SequenceSample(torch.randint(3, 15, (response // 2,), generator=g).tolist(),
                            torch.randint(3, 15, (response,), generator=g).tolist(),
                            {"adv": torch.randn(response, generator=g)}) for _ in range(samples)]
    (mb,) = make_microbatches(batch, token_budget=samples * response * 2)

    def loss_fn(mb, logp_BL, entropy_BL):
        return -(logp_BL * mb["adv"] * mb["response_mask"]).sum() / (samples * response), {}

    blocked, train = [], []
    started = time.perf_counter()
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        strategy.forward_backward(mb, loss_fn, temperature=1.0)
        strategy.step()
        t1 = time.perf_counter()
        ckpt.step_done(step, policy_version=step)
        blocked.append(time.perf_counter() - t1)
        train.append(t1 - t0)
    ckpt.wait()
    wall = time.perf_counter() - started
    state_bytes = sum(t.numel() * t.element_size() for t in strategy.module.parameters()) * 3  # params + 2 Adam moments
    return {"mode": mode, "wall_s": wall, "blocked_median_s": statistics.median(blocked),
            "train_median_s": statistics.median(train), "state_MB": state_bytes / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--samples", type=int, default=8, help="sequences per train step (sets the step's length)")
    ap.add_argument("--response", type=int, default=64, help="response tokens per sequence (prompt: half)")
    args = ap.parse_args()
    from streamrft.runtime.distributed import init_distributed

    dist = init_distributed(timeout_s=600)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(Path(tmp) / "model", args.hidden, args.layers)
        rows = [loop(model_dir, Path(tmp) / mode, mode, args.steps, dist, args.samples, args.response) for mode in ("none", "sync", "async")]
    base = rows[0]["wall_s"]
    for row in rows:
        row["added_per_step_s"] = (row["wall_s"] - base) / args.steps
    print("| mode | state MB | train step s | blocked in step_done s | wall s | added per step s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['state_MB']:.0f} | {r['train_median_s']:.3f} | {r['blocked_median_s']:.3f} | "
              f"{r['wall_s']:.2f} | {r['added_per_step_s']:.3f} |")
    sync, asyn = rows[1], rows[2]
    print(json.dumps({"blocked_async_over_sync": asyn["blocked_median_s"] / sync["blocked_median_s"],
                      "added_async_over_sync": asyn["added_per_step_s"] / max(sync["added_per_step_s"], 1e-9)}))


if __name__ == "__main__":
    main()
