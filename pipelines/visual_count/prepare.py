"""Build the tiny Qwen2-VL and give it a short supervised warm-up on the counting task (format + a little skill).

    python -m pipelines.visual_count.prepare --out runs/visual_count
"""

from __future__ import annotations

import argparse
import time

import torch

from streamrft.models.multimodal import collate_prompts, load_multimodal_policy, response_logprobs_batch
from streamrft.models.vl import build_tiny_qwen2_vl

from pipelines.visual_count.common import accuracy, prompt_inputs
from pipelines.visual_count.task import ALPHABET, make_examples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/visual_count")
    ap.add_argument("--sft_steps", type=int, default=250)  # teaches the answer format; counting skill stays near chance
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    build_tiny_qwen2_vl(f"{args.out}/base", ALPHABET, hidden_size=32, num_layers=1)
    model, processor, _ = load_multimodal_policy(f"{args.out}/base")
    tok = processor.tokenizer
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(args.sft_steps):
        examples = make_examples(args.batch, seed=1000 + step)
        batch = collate_prompts(prompt_inputs(processor, examples), tok.pad_token_id)
        targets = [tok(ans, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for _, ans in examples]
        logp_BT, mask_BT = response_logprobs_batch(model, batch, targets)
        loss = -(logp_BT * mask_BT).sum() / mask_BT.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(f"{args.out}/sft")
    processor.save_pretrained(f"{args.out}/sft")
    held_out = make_examples(200, seed=7)
    print(f"sft: {args.sft_steps} steps, loss {loss.item():.3f}, held-out greedy accuracy "
          f"{accuracy(model, processor, held_out):.3f}, {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
