"""Teacher log-probs of given token ids (pure model math, no I/O).

One padded forward through the decoder body per request, then the output head applied to the needed
positions only, ``chunk_tokens`` rows at a time: full-vocabulary fp32 logits for a whole request
(tokens x vocab x 4 bytes, gigabytes for a long request and a large vocabulary) never exist at once.
"""

from __future__ import annotations

import torch

from streamrft.learner.microbatch import right_pad

CHUNK_TOKENS = 1024  # rows of the output head evaluated at once: 1024 x 152k vocab x 4 B = 0.6 GB at most
BATCH_TOKENS = 8192  # padded tokens per forward: one long and many short sequences are not padded together


def validate_request(token_ids: list[list[int]], prompt_lens: list[int], vocab_size: int, max_tokens: int,
                     max_len: int | None = None) -> None:
    """ValueError naming the sequence and field when the request cannot be scored; cheap, before any forward.
    ``max_len``: the model's context (max_position_embeddings), when it has one."""
    if len(prompt_lens) != len(token_ids):
        raise ValueError(f"prompt_lens has {len(prompt_lens)} entries for {len(token_ids)} sequences (one per sequence)")
    total = sum(len(t) for t in token_ids)
    if total > max_tokens:
        raise ValueError(f"request holds {total} tokens, the limit is --max-tokens={max_tokens}")
    for i, (ids, start) in enumerate(zip(token_ids, prompt_lens)):
        if not 1 <= start <= len(ids):
            raise ValueError(f"sequence {i}: prompt_len={start} must be in [1, {len(ids)}] (its length)")
        if max_len is not None and len(ids) > max_len:
            raise ValueError(f"sequence {i}: {len(ids)} tokens exceed the model's max_position_embeddings={max_len}")
        if ids and not (0 <= min(ids) and max(ids) < vocab_size):
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise ValueError(f"sequence {i}: token id {bad} is outside the vocabulary [0, {vocab_size})")


def _head_split(model):
    """(decoder body, output head) when logits are exactly head(body(x)); None when the model post-
    processes its logits (soft-capping, scaling), which only its own forward applies."""
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    get_decoder = getattr(model, "get_decoder", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if get_decoder is None or head is None:
        return None
    body = get_decoder()
    return (body, head) if body is not None and body is not model else None


@torch.no_grad()
def sequence_logprobs(model, token_ids: list[list[int]], prompt_lens: list[int], pad_id: int = 0,
                      chunk_tokens: int = CHUNK_TOKENS, batch_tokens: int = BATCH_TOKENS) -> list[list[float]]:
    """For each sequence, log p(token_t | tokens_<t) for t in [prompt_len, len), at temperature 1.

    Sequences are right-padded into batches of at most ``batch_tokens`` padded tokens (by length, so a
    long sequence is not padded against many short ones; one longer than that goes alone); position
    ids count real tokens only, so padding does not change any value. Only the ``sum(len - prompt_len)``
    scored positions go through the head.
    """
    for i, t in enumerate(token_ids):
        if not 1 <= prompt_lens[i] <= len(t):
            raise ValueError(f"sequence {i}: prompt_len={prompt_lens[i]} must be in [1, {len(t)}]")
    out: list[list[float]] = [[] for _ in token_ids]
    batch: list[int] = []
    for i in sorted(range(len(token_ids)), key=lambda k: len(token_ids[k])):
        if batch and (len(batch) + 1) * len(token_ids[i]) > batch_tokens:
            _score_batch(model, token_ids, prompt_lens, batch, out, pad_id, chunk_tokens)
            batch = []
        batch.append(i)
    if batch:
        _score_batch(model, token_ids, prompt_lens, batch, out, pad_id, chunk_tokens)
    return out


def _score_batch(model, all_ids: list[list[int]], all_prompt_lens: list[int], which: list[int],
                 out: list[list[float]], pad_id: int, chunk_tokens: int) -> None:
    token_ids = [all_ids[i] for i in which]
    prompt_lens = [all_prompt_lens[i] for i in which]
    device = next(model.parameters()).device
    ids, attn = right_pad(token_ids, pad_id)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    # Row b, position p predicts token p + 1: the scored rows are p in [prompt_len - 1, len - 1).
    rows = [(i, p) for i, t in enumerate(token_ids) for p in range(prompt_lens[i] - 1, len(t) - 1)]
    if not rows:
        return
    b_idx = torch.tensor([r[0] for r in rows])
    p_idx = torch.tensor([r[1] for r in rows])
    targets = ids[b_idx, p_idx + 1].to(device)
    inputs = dict(input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device))
    split = _head_split(model)
    if split is not None:
        body, head = split
        hidden = body(**inputs).last_hidden_state[b_idx.to(device), p_idx.to(device)]  # (R, H)
        project = head
    else:  # the model's own logits; still reduced to the scored rows before the fp32 log-softmax
        hidden = model(**inputs).logits[b_idx.to(device), p_idx.to(device)]
        project = None
    out_rows = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[start : start + chunk_tokens]
        logits = (project(h) if project is not None else h).float()
        logp = torch.log_softmax(logits, dim=-1)
        out_rows.append(logp.gather(-1, targets[start : start + chunk_tokens, None]).squeeze(-1).cpu())
    flat = torch.cat(out_rows).tolist()
    k = 0
    for i, t in zip(which, token_ids):
        n = len(t) - all_prompt_lens[i]
        out[i] = flat[k : k + n]
        k += n
