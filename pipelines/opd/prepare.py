"""Prepare on-policy distillation on arithmetic: a teacher and a smaller, weaker student.

    python pipelines/opd/prepare.py [--config pipelines/opd/config.yaml] [OUT_DIR]

Writes OUT_DIR/teacher (the arith model, warmed up longer), OUT_DIR/student (a smaller model, a short
warm-up), and the arith train/eval sets. Idempotent.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from pipelines.arith.task import ARITH_ALPHABET, greedy_accuracy, write_dataset  # noqa: E402
from streamrft.data import read_rows  # noqa: E402
from streamrft.learner.sft import supervised_warmup  # noqa: E402
from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2, load_policy  # noqa: E402

TEACHER = dict(model=dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128), steps=1500)
STUDENT = dict(model=dict(hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96), steps=300)
WARMUP = dict(lr=3e-3, batch_size=64)


def _build(out: Path, name: str, spec: dict, train_rows, eval_rows, seed: int) -> float:
    final = out / name
    if (final / "config.json").exists():
        return json.loads((final / "warmup.json").read_text())["eval_greedy_accuracy"]
    base = out / f"{name}_base"
    tokenizer = build_char_tokenizer(str(base), ARITH_ALPHABET)
    build_tiny_qwen2(str(base), tokenizer, seed=seed, max_position_embeddings=64, **spec["model"])
    torch.manual_seed(seed)
    model, tokenizer = load_policy(str(base))
    supervised_warmup(model, tokenizer, train_rows, steps=spec["steps"], seed=seed, **WARMUP)
    model.eval()
    accuracy = greedy_accuracy(model, tokenizer, eval_rows, max_new_tokens=6)
    model.save_pretrained(str(final))
    tokenizer.save_pretrained(str(final))
    (final / "warmup.json").write_text(json.dumps({"steps": spec["steps"], "eval_greedy_accuracy": accuracy}))
    return accuracy


def prepare(out_dir: str, seed: int = 0, n_train: int = 4000, n_eval: int = 500) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_path, eval_path = out / "train.jsonl", out / "eval.jsonl"
    if not train_path.exists():
        write_dataset(str(train_path), n_train, seed, split="train")
    if not eval_path.exists():
        write_dataset(str(eval_path), n_eval, seed, split="eval")
    train_rows, eval_rows = read_rows(str(train_path)), read_rows(str(eval_path))
    acc = {name: _build(out, name, spec, train_rows, eval_rows, seed) for name, spec in (("teacher", TEACHER), ("student", STUDENT))}
    return {"teacher": str(out / "teacher"), "student": str(out / "student"), "train_path": str(train_path),
            "eval_path": str(eval_path), "teacher_accuracy": acc["teacher"], "student_accuracy": acc["student"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="runs/opd")
    parser.add_argument("--config", help="accepted for launch/colocate.sh; the output directory is runs/opd")
    args, _overrides = parser.parse_known_args(argv)
    print(json.dumps(prepare(args.out_dir), indent=2))


if __name__ == "__main__":
    main()
