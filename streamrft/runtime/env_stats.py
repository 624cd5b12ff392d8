"""Per-step scalars of multi-turn episodes for steps.jsonl, TensorBoard and Prometheus (env/...).

Over the step's trained samples on all ranks (one all_reduce_sum):
  env/turns_mean                 model turns per episode
  env/tool_calls                 tool calls per episode (EnvStep.info["tool_calls"] summed)
  env/tool_errors                failed tool calls per episode
  env/tool_seconds               tool seconds per episode
  env/observation_token_fraction observation tokens / response tokens (the untrained share)
"""

from __future__ import annotations

import torch


def env_step_stats(batch, all_reduce_sum) -> dict[str, float]:
    rows = []
    for s in batch:
        c = s.header.completion
        n = len(s.response_ids)
        model = n if s.loss_mask is None else int(s.loss_mask.to(torch.int64).sum())
        rows.append([1.0, float(c.turns), c.env_info.get("tool_calls", 0.0), c.env_info.get("tool_errors", 0.0),
                     c.env_info.get("tool_seconds", 0.0), float(n - model), float(n)])
    local = torch.tensor(rows, dtype=torch.float64).sum(0) if rows else torch.zeros(7, dtype=torch.float64)
    n, turns, calls, errors, seconds, obs, tokens = all_reduce_sum(local).tolist()
    per = max(n, 1.0)
    return {"env/turns_mean": turns / per, "env/tool_calls": calls / per, "env/tool_errors": errors / per,
            "env/tool_seconds": seconds / per, "env/observation_token_fraction": obs / max(tokens, 1.0)}
