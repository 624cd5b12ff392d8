"""Held-out evaluation with tools: greedy multi-turn episodes through the demo's environment.

Every held-out row is one episode run like the Generator runs it (``streamrft.envs.episode``): the prompt
rendered with the chat template, model turns decoded without special tokens and handed to ``env.step``,
observations appended as the chat template's token ids (``ObservationRenderer``), up to ``max_turns``
model turns and ``max_tokens`` response tokens. The difference is batching: turn k of every open episode
is one ``generate`` call (greedy, seed 0), so 200 episodes cost a few batched decodes, not 400 single ones.
An episode is correct when ``task.reward`` gives 1.0 on its decoded response, the same text and rule the
training reward uses.

    accuracy        = correct episodes / episodes
    tool_call_rate  = episodes with at least one tool call / episodes   (EnvStep.info["tool_calls"])
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pipelines.calculator.task import reward


@dataclass
class _Open:
    index: int
    context: list[int]
    response: list[int] = field(default_factory=list)
    tool_calls: float = 0.0
    tool_errors: float = 0.0


async def _episodes(engine, tokenizer, rows: list[dict], make_env, max_turns: int, max_tokens: int,
                    max_new_tokens: int) -> list[_Open]:
    from streamrft.data.chat import prompt_ids
    from streamrft.engines.base import GenerationRequest
    from streamrft.envs.render import ObservationRenderer

    renderer = ObservationRenderer(tokenizer)
    envs = [make_env() for _ in rows]
    episodes = []
    try:
        for i, (row, env) in enumerate(zip(rows, envs)):
            greeting = await env.reset({**row, "data_row": i, "sample_id": f"heldout-{i}"})
            prompt = row["prompt"] if not greeting else [*row["prompt"], {"role": "user", "content": greeting}]
            episodes.append(_Open(i, prompt_ids(tokenizer, prompt, loc=f"held-out row {i}")[1]))
        open_ = list(episodes)
        for turn in range(max_turns):
            if not open_:
                break
            requests = [GenerationRequest(f"{e.index}-t{turn}", e.context, seed=0,
                                          max_new_tokens=min(max_new_tokens, max_tokens - len(e.response)))
                        for e in open_]
            outs = await engine.generate_all(requests)
            steps = await asyncio.gather(*(envs[e.index].step(tokenizer.decode(o.response_ids, skip_special_tokens=True))
                                           for e, o in zip(open_, outs)))
            still = []
            for e, out, step in zip(open_, outs, steps):
                e.response += out.response_ids
                e.context += out.response_ids
                e.tool_calls += float(step.info.get("tool_calls", 0))
                e.tool_errors += float(step.info.get("tool_errors", 0))
                if step.done or step.observation is None or turn == max_turns - 1:
                    continue
                obs = renderer.ids(step.role, step.observation, list(e.context))
                if len(e.response) + len(obs) >= max_tokens:
                    continue
                e.response += obs
                e.context += obs
                still.append(e)
            open_ = still
    finally:
        await asyncio.gather(*(env.close() for env in envs), return_exceptions=True)
    return episodes


def heldout_with_tools(model, tokenizer, rows: list[dict], make_env, max_turns: int = 3, max_tokens: int = 160,
                       max_new_tokens: int = 80, batch_size: int = 256) -> dict[str, float]:
    """``{"accuracy", "tool_call_rate", "tool_error_rate", "n"}`` of greedy episodes over ``rows``."""
    from streamrft.config.engine import EngineConfig
    from streamrft.engines.hf import HFEngine

    if not rows:
        raise ValueError("heldout_with_tools got no rows; pass at least one {'prompt', 'reference'} row")
    cfg = EngineConfig(top_k=1, max_new_tokens=max_new_tokens, max_batch_size=batch_size)
    engine = HFEngine(model, cfg, [tokenizer.eos_token_id], tokenizer.pad_token_id, next(model.parameters()).device)
    episodes = asyncio.run(_episodes(engine, tokenizer, rows, make_env, max_turns, max_tokens, max_new_tokens))
    n = len(rows)
    correct = sum(reward(tokenizer.decode(e.response, skip_special_tokens=True), rows[e.index]["reference"])
                  for e in episodes)
    return {"accuracy": correct / n, "tool_call_rate": sum(e.tool_calls > 0 for e in episodes) / n,
            "tool_error_rate": sum(e.tool_errors > 0 for e in episodes) / n, "n": n}
