"""Teacher log-probs of given token ids: one padded forward per request (pure model math, no I/O)."""

from __future__ import annotations

import torch


@torch.no_grad()
def sequence_logprobs(model, token_ids: list[list[int]], prompt_lens: list[int], pad_id: int = 0) -> list[list[float]]:
    """For each sequence, log p(token_t | tokens_<t) for t in [prompt_len, len), at temperature 1.

    Sequences are right-padded into one batch; position ids count real tokens only, so padding does
    not change any value.
    """
    if not token_ids:
        return []
    device = next(model.parameters()).device
    L = max(len(t) for t in token_ids)
    ids = torch.full((len(token_ids), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(token_ids), L), dtype=torch.long)
    for i, t in enumerate(token_ids):
        ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        attn[i, : len(t)] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device)).logits.float()
    logp_BLV = torch.log_softmax(logits[:, :-1], dim=-1)
    target = ids[:, 1:].to(device)
    logp_BL = logp_BLV.gather(-1, target.unsqueeze(-1)).squeeze(-1).cpu()
    out = []
    for i, t in enumerate(token_ids):
        start = prompt_lens[i]
        if not 1 <= start <= len(t):
            raise ValueError(f"sequence {i}: prompt_len={start} must be in [1, {len(t)}]")
        out.append(logp_BL[i, start - 1 : len(t) - 1].tolist())
    return out
