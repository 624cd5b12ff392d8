"""`streamrft replay RUN_DIR`: train a fresh learner on a run's recorded batches (streamrft/runtime/replay.py)
and check that every step's loss and grad norm equal the recorded ones bitwise."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import torch

from streamrft.runtime.replay import ReplayError, batches_dir, compare, load_batch, recorded_steps


def replay_run(run_dir: str | Path, out_dir: str | Path) -> list[dict]:
    """Train a fresh learner on ``run_dir``'s recorded batches; returns the replayed per-step stats
    (one rank per recorded rank: run under torchrun with the run's learner world size)."""
    from streamrft.checkpoint import set_deterministic
    from streamrft.compose import build_learner
    from streamrft.config import Config
    from streamrft.runtime.distributed import init_distributed

    config_path = batches_dir(run_dir) / "config.json"
    if not config_path.exists():
        raise ReplayError(f"{config_path} is missing: the run was not made with train.record_batches=true")
    cfg = msgspec.json.decode(config_path.read_bytes(), type=Config)
    cfg = msgspec.structs.replace(cfg, output_dir=str(out_dir))
    recorded = recorded_steps(run_dir)
    dist = init_distributed(timeout_s=cfg.rollout.stage_timeout_s)
    torch.manual_seed(cfg.seed)
    set_deterministic(True)
    _, _, _, actor = build_learner(cfg, dist)
    replayed = []
    for row in recorded:
        batch = load_batch(run_dir, dist.rank, row["step"] - 1)
        stats = actor.train_step(batch.samples)
        replayed.append({"step": row["step"], **stats})
    if dist.rank == 0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / "replayed_steps.jsonl", "w") as f:
            for row in replayed:
                f.write(json.dumps(row) + "\n")
    return replayed


def replay_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="streamrft replay", description=(
        "Train a fresh learner on a run's recorded batches (train.record_batches=true) and check that every "
        "step's loss and grad norm equal the recorded ones bitwise. Run with the run's learner world size "
        "(torchrun for more than one rank)."))
    parser.add_argument("run_dir", help="the recorded run's output_dir")
    parser.add_argument("--out", default="", help="where to write replayed_steps.jsonl (default RUN_DIR/replay)")
    args = parser.parse_args(argv)
    from streamrft.runtime.distributed import destroy_distributed

    try:
        replayed = replay_run(args.run_dir, args.out or str(Path(args.run_dir) / "replay"))
        diffs = compare(recorded_steps(args.run_dir), replayed)
    except ReplayError as exc:
        print(f"streamrft replay: {exc}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed()
    if diffs:
        print("streamrft replay: the replay differs from the recorded run:\n  " + "\n  ".join(diffs[:20]), file=sys.stderr)
        return 1
    print(f"replay: steps={len(replayed)} bitwise_equal=true")
    return 0
