"""GRPO on visual counting with the tiny Qwen2-VL, in one process (a compact stand-in for `streamrft train`
until the runtime carries media): HFEngine samples n responses per prompt (pixel_values in the prefill,
M-RoPE positions, KV-cached decode), the rule reward scores them, group_norm gives advantages, ppo_clip +
aggregate_loss give the loss over response tokens, recomputed with response_logprobs_batch; AdamW steps.

    python -m pipelines.visual_count.train --model runs/visual_count/sft
"""

from __future__ import annotations

import argparse
import time

import torch

from streamrft.algorithms import AdvantageInputs, PolicyLossInputs, aggregate_loss, group_norm, ppo_clip
from streamrft.config.algorithm import AlgorithmConfig
from streamrft.config.engine import EngineConfig
from streamrft.engines.hf import HFEngine
from streamrft.models.multimodal import collate_prompts, freeze_prefix, load_multimodal_policy, response_logprobs_batch

from pipelines.visual_count.common import accuracy, generate, prompt_inputs
from pipelines.visual_count.task import make_examples, reward


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="runs/visual_count/sft")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=16)  # prompts per step
    ap.add_argument("--n", type=int, default=8)  # samples per prompt
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--freeze_prefix", nargs="*", default=[])  # e.g. model.visual.
    ap.add_argument("--eval_size", type=int, default=200)
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    model, processor, _ = load_multimodal_policy(args.model)
    freeze_prefix(model, args.freeze_prefix)
    tok = processor.tokenizer
    held_out = make_examples(args.eval_size, seed=7)
    before = accuracy(model, processor, held_out)
    engine = HFEngine(model, EngineConfig(temperature=1.0, max_new_tokens=2), [tok.eos_token_id], tok.pad_token_id,
                      torch.device("cpu"))
    algo = AlgorithmConfig()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    for step in range(args.steps):
        examples = make_examples(args.prompts, seed=50_000 + step)
        inputs = prompt_inputs(processor, examples)
        samples, index = generate(engine, inputs, args.n, seed=step)
        rewards_B = torch.tensor([reward(tok.decode(s.response_ids, skip_special_tokens=True), examples[i][1])
                                  for s, i in zip(samples, index)])
        batch = collate_prompts([inputs[i] for i in index], tok.pad_token_id)
        model.train()
        logp_BT, mask_BT = response_logprobs_batch(model, batch, [s.response_ids for s in samples])
        adv = group_norm(AdvantageInputs(rewards_B, torch.tensor(index), mask_BT), algo).advantages
        out = ppo_clip(PolicyLossInputs(logp_BT, logp_BT.detach(), adv, mask_BT), algo)
        loss = aggregate_loss(out.loss, mask_BT, algo.loss_agg_mode, mask_BT.sum().item(), len(samples),
                              int(mask_BT.shape[1]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step}: mean reward {rewards_B.mean():.3f}")
    after = accuracy(model, processor, held_out)
    print(f"held-out greedy accuracy before {before:.3f} -> after {after:.3f}; {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
