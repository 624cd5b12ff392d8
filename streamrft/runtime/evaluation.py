"""Held-out evaluation: greedy decoding of every held-out prompt, scored by the run's reward sources.

Each rank evaluates rows rank, rank + W, ...; sums are all-reduced, so the number is the same for
any number of ranks. ``accuracy`` counts samples whose reward reaches ``correct_threshold``.

Multi-turn runs (``env`` = the config's env section with ``env.name`` set): every held-out row is a greedy
episode against the environment, exactly as in training (streamrft.envs.episode), and the reward sources
score the whole decoded response; ``heldout_env_turns_mean`` and ``heldout_env_tool_calls`` (per episode)
are added. An episode whose environment raises scores 0 and is counted in ``heldout_env_errors``.

Media rows: ``media`` (the Generator's ``MediaCodec``, passed by the driver) decodes each row's images / audio into the engine's
``mm_inputs``. A held-out row whose media cannot be read scores 0 and is counted in ``heldout_media_errors``.
"""

from __future__ import annotations

import logging

import msgspec
import torch

from protocols import RewardItem
from streamrft.data.chat import has_media_parts, prompt_ids
from streamrft.data.errors import DataError
from streamrft.engines.base import GenerationRequest
from streamrft.rewards.conventions import reward_columns

log = logging.getLogger("streamrft")


async def evaluate(engine, tokenizer, dataset, scorer, rank: int, world_size: int, all_reduce_sum, limit: int = 0, correct_threshold: float = 1.0, media=None, chat_template: str = "auto", system_prompt: str = "", env=None, model_path: str = "", max_new_tokens: int = 0, call_timeout_s: float = 600.0) -> dict[str, float]:
    rows = dataset.rows[:limit] if limit else dataset.rows
    mine = rows[rank::world_size]
    requests, mm, kept, errors, texts, refs = [], {}, [], 0, {}, {}
    prompt_field = getattr(dataset, "fields", {}).get("prompt", "prompt")  # for errors: the field data.format read
    for i, r in enumerate(mine):
        if media is None:  # the Generator's rendering: text as-is, messages through the chat template
            if has_media_parts(r.prompt):  # placeholders without pixels would be scored as if they were text
                raise DataError(f"{dataset.path}: row {r.row} field {prompt_field!r} has image / video / audio "
                                "message parts but the training rows have no media; evaluate on rows of the same kind")
            texts[i], ids = prompt_ids(tokenizer, r.prompt, chat_template, system_prompt,
                                       f"{dataset.path}: row {r.row} field {prompt_field!r}")
        else:
            from streamrft.data.media import MediaError

            try:  # the Generator's media path: data.*_field media, or message prompts with media parts
                texts[i], refs[i], inputs = media.prompt(r, dataset.path, prompt_field, chat_template, system_prompt)
            except MediaError as exc:
                errors += 1
                log.warning("evaluation rank %d: %s", rank, exc)
                continue
            ids = inputs["input_ids"][0].tolist()
            mm[str(i)] = inputs
        requests.append(GenerationRequest(request_id=str(i), prompt_ids=ids, seed=0))
        kept.append((i, r))
    if env is not None and env.name:
        return await _evaluate_episodes(engine, tokenizer, env, model_path, max_new_tokens, requests, kept, texts, scorer,
                                        rank, all_reduce_sum, correct_threshold, chat_template, system_prompt, dataset.path,
                                        call_timeout_s)
    generation = engine.generate(requests, mm_inputs=mm) if mm else engine.generate(requests)
    outputs = {out.request_id: out async for out in generation} if requests else {}
    items = [
        RewardItem(
            sample_id=f"eval-{rank}-{i}",
            prompt=texts.get(i, r.prompt),
            response=tokenizer.decode(outputs[str(i)].response_ids, skip_special_tokens=True),
            reference=r.reference,
            label=r.label,
            columns=reward_columns(r.extra, r.prompt),
            media=refs.get(i, []),  # as the reward stage: a media reward model scores the prompt's media too
        )
        for i, r in kept
    ]
    return await _score(items, scorer, all_reduce_sum, correct_threshold, errors,
                        extra="heldout_media_errors" if media is not None else None)


async def _evaluate_episodes(engine, tokenizer, env, model_path, max_new_tokens, requests, kept, texts, scorer, rank,
                             all_reduce_sum, correct_threshold, chat_template, system_prompt, path,
                             call_timeout_s: float) -> dict[str, float]:
    """Held-out rows as greedy episodes (their model turns batched per turn), then scored like single turns.
    Every environment call waits at most ``call_timeout_s`` (rollout.stage_timeout_s), as in training."""
    import asyncio

    from streamrft.envs.episode import (EngineTurnError, TurnBatcher, env_call, environment_factory, max_positions,
                                        prompt_with_reset_text, run_episode)
    from streamrft.envs.render import ObservationRenderer

    factory, renderer = environment_factory(env, rank), ObservationRenderer(tokenizer, chat_template)
    limit, batcher = max_positions(model_path) if model_path else None, TurnBatcher(engine)

    async def one(request, i, r):
        e = None
        try:
            e = factory()
            row = {**reward_columns(r.extra, r.prompt), "prompt": r.prompt, "reference": r.reference, "label": r.label,
                   "data_row": r.row, "sample_id": f"heldout-{r.row}"}
            reset = await env_call(e.reset(row), f"{type(e).__name__}.reset", call_timeout_s)
            text, ids = prompt_with_reset_text(tokenizer, r.prompt, texts[i], request.prompt_ids, reset, chat_template,
                                               system_prompt, f"{path}: row {r.row}")
            return i, text, await run_episode(e, batcher, renderer, ids, f"heldout-{i}", (0, 0, i, 0), env.max_turns,
                                              env.max_tokens, max_new_tokens, limit, call_timeout_s)
        except EngineTurnError:
            raise
        except Exception as exc:  # the environment failed this row: it scores 0, counted
            log.warning("evaluation rank %d: row %d: environment %r failed: %s: %s", rank, r.row, env.name,
                        type(exc).__name__, exc)
            return i, None, None
        finally:
            batcher.leave()
            if e is not None:
                try:
                    await env_call(e.close(), f"{type(e).__name__}.close", call_timeout_s)
                except Exception as exc:  # a failing close must not hide the row's own outcome
                    log.warning("evaluation rank %d: environment %r close() raised %s: %s", rank, env.name,
                                type(exc).__name__, exc)

    for _ in kept:
        batcher.enter()
    try:
        done = await asyncio.gather(*(one(q, i, r) for q, (i, r) in zip(requests, kept)))
        await batcher.drain()
    finally:
        client = getattr(factory, "client", None)  # a serve-env client, made for this evaluation: its sockets
        if client is not None:  # and threads would otherwise outlive it, one set per held-out evaluation
            await client.close()
    rows = dict(kept)
    items, episodes = [], []
    for i, text, ep in done:
        if ep is None:
            continue
        episodes.append(ep)
        r = rows[i]
        items.append(RewardItem(sample_id=f"eval-{rank}-{i}", prompt=text,
                                response=tokenizer.decode(ep.response_ids, skip_special_tokens=True),
                                reference=r.reference, label=r.label, columns=reward_columns(r.extra, r.prompt)))
    failed = len(done) - len(episodes)
    out = await _score(items, scorer, all_reduce_sum, correct_threshold, failed, extra="heldout_env_errors")
    sums = all_reduce_sum(torch.tensor([float(len(episodes)), float(sum(e.turns for e in episodes)),
                                        float(sum(e.info.get("tool_calls", 0.0) for e in episodes))], dtype=torch.float64))
    n = max(sums[0].item(), 1.0)
    out["heldout_env_turns_mean"] = sums[1].item() / n
    out["heldout_env_tool_calls"] = sums[2].item() / n
    return out


async def _score(items, scorer, all_reduce_sum, correct_threshold, n_errors: int = 0, extra=None) -> dict[str, float]:
    """Score ``items``, add ``n_errors`` rows worth 0, reduce over ranks; ``extra`` names the error count."""
    outcomes = await scorer.score(items) if items else []
    rewards = [o.reward if not o.error else 0.0 for o in outcomes] + [0.0] * n_errors
    sums = [float(len(rewards)), float(sum(rewards)), float(sum(r >= correct_threshold for r in rewards))]
    if extra is not None:
        sums.append(float(n_errors))
    total = all_reduce_sum(torch.tensor(sums, dtype=torch.float64))
    n = max(total[0].item(), 1.0)
    out = {"heldout_reward_mean": total[1].item() / n, "heldout_accuracy": total[2].item() / n, "heldout_n": total[0].item()}
    if extra is not None:
        out[extra] = total[3].item()
    return out


def greedy_engine_config(engine_cfg):
    """The run's engine settings with greedy decoding (top_k=1) for evaluation."""
    return msgspec.structs.replace(engine_cfg, top_k=1, top_p=1.0, temperature=1.0, first_token_temperature=0.0)
