"""Prepare the GRM demo: a judge backbone (tiny Qwen2 over GRM_ALPHABET, warmed up on arith) and
train/eval judgment rows.

    python pipelines/grm/prepare.py OUT_DIR [--seed 0] [--warmup-steps 1400]

Writes ``OUT_DIR/backbone``, ``OUT_DIR/judge_train.jsonl``, ``OUT_DIR/judge_eval.jsonl``. Idempotent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipelines.arith.prepare import TASK  # noqa: E402
from pipelines.common import write_jsonl  # noqa: E402
from pipelines.grm.task import GRM_ALPHABET, make_judgments  # noqa: E402
from pipelines.srm.prepare import build_backbone  # noqa: E402


def prepare(out_dir: str, seed: int = 0, warmup_steps: int = 1400, n_train: int = 8000, n_eval: int = 300) -> dict:
    out = Path(out_dir)
    backbone = build_backbone(str(out / "backbone"), seed, warmup_steps, alphabet=GRM_ALPHABET)
    train_path, eval_path = str(out / "judge_train.jsonl"), str(out / "judge_eval.jsonl")
    if not os.path.isfile(train_path):
        write_jsonl(train_path, make_judgments("train", n_train, seed, **TASK))
    if not os.path.isfile(eval_path):
        write_jsonl(eval_path, make_judgments("eval", n_eval, seed + 1, **TASK))
    return {"backbone": backbone, "train_path": train_path, "eval_path": eval_path}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=1400)
    args = parser.parse_args(argv)
    print(json.dumps(prepare(args.out_dir, args.seed, args.warmup_steps), indent=2))


if __name__ == "__main__":
    main()
