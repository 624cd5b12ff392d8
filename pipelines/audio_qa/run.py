"""End to end on CPU with the tiny Qwen2-Audio: build, supervised format warm-up, then GRPO steps
(HFEngine generation with input_features in the prefill, rule reward, group_norm + ppo_clip).

    python -m pipelines.audio_qa.run --out runs/audio_qa
"""

from __future__ import annotations

import argparse
import time

import torch

from streamrft.algorithms import AdvantageInputs, PolicyLossInputs, aggregate_loss, group_norm, ppo_clip
from streamrft.config.algorithm import AlgorithmConfig
from streamrft.config.engine import EngineConfig
from streamrft.engines.hf import HFEngine
from streamrft.models.audio import build_tiny_qwen2_audio
from streamrft.models.multimodal import build_model_inputs, collate_prompts, load_multimodal_policy, response_logprobs_batch

from pipelines.audio_qa.task import ALPHABET, PROMPT, make_examples, reward
from pipelines.visual_count.common import generate


def _inputs(processor, examples):
    return [build_model_inputs(processor, PROMPT, {"audios": [wave]}) for wave, _ in examples]


def _score(tok, samples, index, examples) -> torch.Tensor:
    return torch.tensor([reward(tok.decode(s.response_ids, skip_special_tokens=True), examples[i][1])
                         for s, i in zip(samples, index)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/audio_qa")
    ap.add_argument("--sft_steps", type=int, default=40)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    build_tiny_qwen2_audio(f"{args.out}/base", ALPHABET)
    model, processor, _ = load_multimodal_policy(f"{args.out}/base")
    tok = processor.tokenizer
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.sft_steps):  # format warm-up: a letter then EOS
        ex = make_examples(16, seed=1000 + step)
        targets = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for _, a in ex]
        logp_BT, mask_BT = response_logprobs_batch(model, collate_prompts(_inputs(processor, ex), tok.pad_token_id), targets)
        loss = -(logp_BT * mask_BT).sum() / mask_BT.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    held_out = make_examples(100, seed=7)
    greedy = HFEngine(model, EngineConfig(top_k=1, max_new_tokens=2), [tok.eos_token_id], tok.pad_token_id, "cpu")
    engine = HFEngine(model, EngineConfig(max_new_tokens=2), [tok.eos_token_id], tok.pad_token_id, "cpu")
    held_inputs = _inputs(processor, held_out)

    def accuracy() -> float:
        samples, index = generate(greedy, held_inputs, 1, 0)
        return _score(tok, samples, index, held_out).mean().item()

    before = accuracy()
    algo = AlgorithmConfig()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        ex = make_examples(args.prompts, seed=50_000 + step)
        inputs = _inputs(processor, ex)
        samples, index = generate(engine, inputs, args.n, seed=step)
        rewards_B = _score(tok, samples, index, ex)
        model.train()
        logp_BT, mask_BT = response_logprobs_batch(model, collate_prompts([inputs[i] for i in index], tok.pad_token_id),
                                                   [s.response_ids for s in samples])
        adv = group_norm(AdvantageInputs(rewards_B, torch.tensor(index), mask_BT), algo).advantages
        out = ppo_clip(PolicyLossInputs(logp_BT, logp_BT.detach(), adv, mask_BT), algo)
        loss = aggregate_loss(out.loss, mask_BT, algo.loss_agg_mode, mask_BT.sum().item(), len(samples), mask_BT.shape[1])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step}: mean reward {rewards_B.mean():.3f}")
    print(f"held-out greedy accuracy before {before:.3f} -> after {accuracy():.3f}; {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
