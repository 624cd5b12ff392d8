"""Build the tiny Qwen2-VL, give it a short supervised warm-up on the counting task (format + a little skill),
and write the image datasets the runtime trains on (train.jsonl / eval.jsonl + PNG files).

    python -m pipelines.visual_count.prepare --out runs/visual_count
    streamrft train pipelines/visual_count/config.yaml
"""

from __future__ import annotations

import argparse
import time

import torch

from streamrft.models.multimodal import load_multimodal_policy
from streamrft.models.vl import build_tiny_qwen2_vl

from pipelines.common import answer_warmup
from pipelines.visual_count.common import accuracy, prompt_inputs
from pipelines.visual_count.task import ALPHABET, make_examples, write_split


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/visual_count")
    ap.add_argument("--sft_steps", type=int, default=250)  # teaches the answer format; counting skill stays near chance
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--n_train", type=int, default=2000)  # rows of train.jsonl
    ap.add_argument("--n_eval", type=int, default=200)  # rows of eval.jsonl (the held-out set, seed 7)
    args = ap.parse_args()
    prepare(args.out, args.sft_steps, args.batch, args.lr, args.n_train, args.n_eval)


def prepare(out: str, sft_steps: int = 250, batch_size: int = 32, lr: float = 3e-3, n_train: int = 2000,
            n_eval: int = 200) -> None:
    """Model under out/sft, data under out/{train,eval}.jsonl; prints the warm-up's held-out accuracy."""
    args = argparse.Namespace(out=out, sft_steps=sft_steps, batch=batch_size, lr=lr)
    torch.manual_seed(0)
    t0 = time.time()
    build_tiny_qwen2_vl(f"{args.out}/base", ALPHABET, hidden_size=32, num_layers=1)
    model, processor, _ = load_multimodal_policy(f"{args.out}/base")

    def batch(step: int) -> tuple[list[dict], list[str]]:
        examples = make_examples(args.batch, seed=1000 + step)
        return prompt_inputs(processor, examples), [answer for _, answer in examples]

    loss = answer_warmup(model, processor, args.sft_steps, batch, lr=args.lr)
    model.save_pretrained(f"{args.out}/sft")
    processor.save_pretrained(f"{args.out}/sft")
    write_split(args.out, "train", n_train, seed=11)
    write_split(args.out, "eval", n_eval, seed=7)
    held_out = make_examples(min(n_eval, 200), seed=7)
    print(f"sft: {args.sft_steps} steps, loss {loss.item():.3f}, held-out greedy accuracy "
          f"{accuracy(model, processor, held_out):.3f}, {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
