"""Held-out evaluation: greedy decoding of every held-out prompt, scored by the run's reward sources.

Each rank evaluates rows rank, rank + W, ...; sums are all-reduced, so the number is the same for
any number of ranks. ``accuracy`` counts samples whose reward reaches ``correct_threshold``.
"""

from __future__ import annotations

import msgspec
import torch

from protocols import RewardItem
from streamrft.engines.base import GenerationRequest


async def evaluate(engine, tokenizer, dataset, scorer, rank: int, world_size: int, all_reduce_sum, limit: int = 0, correct_threshold: float = 1.0) -> dict[str, float]:
    rows = dataset.rows[:limit] if limit else dataset.rows
    mine = rows[rank::world_size]
    requests = [
        GenerationRequest(request_id=str(i), prompt_ids=tokenizer.encode(r.prompt, add_special_tokens=False), seed=0)
        for i, r in enumerate(mine)
    ]
    outputs = {out.request_id: out async for out in engine.generate(requests)} if requests else {}
    items = [
        RewardItem(
            sample_id=f"eval-{rank}-{i}",
            prompt=r.prompt,
            response=tokenizer.decode(outputs[str(i)].response_ids, skip_special_tokens=True),
            reference=r.reference,
            label=r.label,
        )
        for i, r in enumerate(mine)
    ]
    outcomes = await scorer.score(items) if items else []
    rewards = [o.reward if not o.error else 0.0 for o in outcomes]
    sums = torch.tensor(
        [float(len(rewards)), float(sum(rewards)), float(sum(r >= correct_threshold for r in rewards))],
        dtype=torch.float64,
    )
    total = all_reduce_sum(sums)
    n = max(total[0].item(), 1.0)
    return {"heldout_reward_mean": total[1].item() / n, "heldout_accuracy": total[2].item() / n, "heldout_n": total[0].item()}


def greedy_engine_config(engine_cfg):
    """The run's engine settings with greedy decoding (top_k=1) for evaluation."""
    return msgspec.structs.replace(engine_cfg, top_k=1, top_p=1.0, temperature=1.0, first_token_temperature=0.0)
