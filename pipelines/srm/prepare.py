"""Prepare the SRM demo: a backbone (the tiny arith model after a supervised warm-up) and
train/eval preference pairs.

    python pipelines/srm/prepare.py OUT_DIR [--seed 0] [--warmup-steps 3000]

Writes ``OUT_DIR/backbone`` (Hugging Face format), ``OUT_DIR/pairs_train.jsonl`` and
``OUT_DIR/pairs_eval.jsonl``. Idempotent: a step whose outputs exist is skipped. The backbone is the
arith demo's model shape (pipelines/arith/prepare.py MODEL) warmed up longer than the RL policy: the
RM must know the sums to judge them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from pipelines.arith.prepare import MODEL, TASK, WARMUP  # noqa: E402
from pipelines.arith.task import ARITH_ALPHABET, make_rows  # noqa: E402
from pipelines.common import write_jsonl  # noqa: E402
from pipelines.srm.task import make_pairs  # noqa: E402
from streamrft.learner.sft import supervised_warmup  # noqa: E402
from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2, load_policy  # noqa: E402

PAIRS_PER_PROBLEM = 4  # rejected answers per train problem (9011 train problems)
HARD_FRACTION = 0.0  # share of rejected answers that are extra carry slips (task.HARD_OFFSETS); 0.5 measured worse


def build_backbone(out_dir: str, seed: int, warmup_steps: int, alphabet: str = ARITH_ALPHABET) -> str:
    """A tiny Qwen2 over ``alphabet`` warmed up on arith (prompt -> sum) for ``warmup_steps``."""
    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    tokenizer = build_char_tokenizer(out_dir, alphabet)
    build_tiny_qwen2(out_dir, tokenizer, seed=seed, **MODEL)
    torch.manual_seed(seed)
    model, tokenizer = load_policy(out_dir)
    rows = make_rows(4000, seed, split="train", **TASK)
    start = time.perf_counter()
    losses = supervised_warmup(model, tokenizer, rows, steps=warmup_steps, seed=seed, lr=WARMUP["lr"],
                               batch_size=WARMUP["batch_size"], log_every=0)
    model.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "warmup.json"), "w") as f:
        json.dump({"steps": warmup_steps, "seconds": round(time.perf_counter() - start, 2),
                   "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:]))}, f)
    return out_dir


def prepare(out_dir: str, seed: int = 0, warmup_steps: int = 3000, n_train: int | None = 36000, n_eval: int = 500,
            pairs_per_problem: int = PAIRS_PER_PROBLEM, hard_fraction: float = HARD_FRACTION) -> dict:
    """Returns ``{"backbone", "train_path", "eval_path"}``.

    Training pairs: ``pairs_per_problem`` rejected answers for every train problem (``n_train`` = None:
    all of them), ``hard_fraction`` of them carry slips (pipelines.srm.task.wrong_answer). Held-out pairs:
    one near miss (the default mix, no extra carry slips) for each of ``n_eval`` eval problems. The train
    file is rewritten when its settings (``pairs_train.json``) differ from the requested ones.
    """
    out = Path(out_dir)
    backbone = build_backbone(str(out / "backbone"), seed, warmup_steps)
    train_path, eval_path = str(out / "pairs_train.jsonl"), str(out / "pairs_eval.jsonl")
    settings = {"seed": seed, "n_train": n_train, "pairs_per_problem": pairs_per_problem, "hard_fraction": hard_fraction}
    meta = out / "pairs_train.json"
    if not os.path.isfile(train_path) or not meta.is_file() or json.loads(meta.read_text()) != settings:
        rows = make_pairs("train", n_train or 10 ** 9, seed, pairs_per_problem=pairs_per_problem,
                          hard_fraction=hard_fraction, **TASK)
        write_jsonl(train_path, rows)
        meta.write_text(json.dumps(settings))
    if not os.path.isfile(eval_path):
        write_jsonl(eval_path, make_pairs("eval", n_eval, seed + 1, **TASK))
    return {"backbone": backbone, "train_path": train_path, "eval_path": eval_path}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=3000)
    args = parser.parse_args(argv)
    print(json.dumps(prepare(args.out_dir, args.seed, args.warmup_steps), indent=2))


if __name__ == "__main__":
    main()
