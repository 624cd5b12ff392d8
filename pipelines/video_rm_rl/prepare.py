"""Everything the video RM RL demo trains from, under one folder (default runs/video_rm_rl):

- videos and rows: train.jsonl / eval.jsonl (RL prompts, mp4 files), rm_train.jsonl / rm_eval.jsonl
  (preference pairs on other videos) (task.py);
- policy: a tiny Qwen2-VL with a short supervised warm-up (``sft_steps``): it learns most of the answer
  format and part of the skill, so RL has room to raise it (sft/). When these tiny models start telling red,
  green and blue apart depends on the init seed (measured on 100 held-out videos: seed 0 not within 80 steps;
  seed 2 from about 25 steps, all four colours by 50); ``policy_seed`` 2 with 25 steps is mid-way: the
  4-way argmax is right on 0.67 of videos, P(correct answer) 0.28, 0.72 of the mass on well-formed answers.
  A policy that cannot yet see the colour is not something 20 RL steps teach (seed 0: 0.44 -> 0.39);
- reward-model backbone: a tiny Qwen2-VL of the same shape, other seed, warmed up longer
  (``rm_warmup_steps``) on other videos to name the colour (rm_base/); the RM itself is trained from it
  by `streamrft train-rm pipelines/video_rm_rl/rm.yaml` (demo.py does it).

    python -m pipelines.video_rm_rl.prepare --out runs/video_rm_rl
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from PIL import Image

from streamrft.models.multimodal import build_model_inputs, collate_prompts, load_multimodal_policy, response_logprobs_batch
from streamrft.models.vl import build_tiny_qwen2_vl

from pipelines.video_rm_rl.task import ALPHABET, PROMPT, make_examples, write_split

SHAPE = dict(hidden_size=64, num_layers=2, vision_dim=64, image_size=16)  # 32/1 learns no colour from video


def video_inputs(processor, examples) -> list[dict]:
    return [build_model_inputs(processor, PROMPT, {"videos": [[Image.fromarray(f) for f in frames]]})
            for frames, _ in examples]


def warm_up(base: str, out: str, steps: int, batch_size: int = 32, lr: float = 3e-3, seed: int = 0,
            data_seed: int = 1000, pool: int = 512) -> float:
    """Supervised warm-up on batches drawn from ``pool`` examples processed once (the processor, not the
    model, is most of a step's CPU time); saves to ``out``; returns the last loss."""
    torch.manual_seed(seed)
    model, processor, _ = load_multimodal_policy(base)
    tok = processor.tokenizer
    examples = make_examples(min(pool, steps * batch_size), seed=data_seed)
    inputs = video_inputs(processor, examples)
    targets = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for _, c in examples]
    order = torch.Generator().manual_seed(data_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        pick = torch.randperm(len(examples), generator=order)[:batch_size].tolist()
        batch = collate_prompts([inputs[i] for i in pick], tok.pad_token_id)
        logp_BT, mask_BT = response_logprobs_batch(model, batch, [targets[i] for i in pick])
        loss = -(logp_BT * mask_BT).sum() / mask_BT.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return float(loss.detach())


def prepare(out: str, sft_steps: int = 25, n_train: int = 256, n_eval: int = 100, n_pairs: int = 200,
            n_pair_eval: int = 40, rm_warmup_steps: int = 200, policy_seed: int = 2) -> None:
    """Idempotent per part: a part whose output exists is kept (delete the folder to start afresh).
    ``n_pairs`` / ``n_pair_eval`` count videos (5 strict and 4 tie preference rows each, task.write_split);
    with 200 videos, a 200-step RM backbone and rm.yaml (500 steps of 16 pairs, lr 5e-4 cosine) the RM ranks the
    true colour first on all 40 held-out videos (from a 100-step backbone: 0.65; at lr 3e-3: 0.53-0.72)."""
    t0 = time.time()
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "sft" / "config.json").is_file():
        build_tiny_qwen2_vl(str(root / "base"), ALPHABET, seed=policy_seed, **SHAPE)
        loss = warm_up(str(root / "base"), str(root / "sft"), sft_steps)
        print(f"policy warm-up: {sft_steps} steps, loss {loss:.3f}")
    if not (root / "rm_base" / "config.json").is_file():
        # The RM starts from a VL model that has been taught to name the colours (as an RM usually starts
        # from an SFT model): from a random backbone, 200 Bradley-Terry steps ranked the true colour first on
        # only 48-72 % of held-out videos, and the policy learned the RM's mistakes.
        build_tiny_qwen2_vl(str(root / "rm_init"), ALPHABET, seed=1, **SHAPE)
        loss = warm_up(str(root / "rm_init"), str(root / "rm_base"), rm_warmup_steps, seed=1, data_seed=5000)
        print(f"RM backbone warm-up: {rm_warmup_steps} steps, loss {loss:.3f}")
    for name, n, seed, pairs in (("train", n_train, 11, False), ("eval", n_eval, 7, False),
                                 ("rm_train", n_pairs, 21, True), ("rm_eval", n_pair_eval, 23, True)):
        if not (root / f"{name}.jsonl").is_file():
            write_split(out, name, n, seed, pairs=pairs)
    print(f"prepared {out} in {time.time() - t0:.1f}s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/video_rm_rl")
    ap.add_argument("--sft_steps", type=int, default=25)
    ap.add_argument("--n_train", type=int, default=256)
    ap.add_argument("--n_eval", type=int, default=100)
    ap.add_argument("--n_pairs", type=int, default=200)
    args = ap.parse_args()
    prepare(args.out, args.sft_steps, args.n_train, args.n_eval, args.n_pairs)


if __name__ == "__main__":
    main()
