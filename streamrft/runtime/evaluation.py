"""Held-out evaluation: greedy decoding of every held-out prompt, scored by the run's reward sources.

Each rank evaluates rows rank, rank + W, ...; sums are all-reduced, so the number is the same for
any number of ranks. ``accuracy`` counts samples whose reward reaches ``correct_threshold``.

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


async def evaluate(engine, tokenizer, dataset, scorer, rank: int, world_size: int, all_reduce_sum, limit: int = 0, correct_threshold: float = 1.0, media=None, chat_template: str = "auto", system_prompt: str = "") -> dict[str, float]:
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
