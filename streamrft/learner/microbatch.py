"""Token-budget microbatching: whole sequences packed into right-padded (B, L) tensors.

A microbatch dict holds
  input_ids      (B, L) int64, prompt + response, right-padded with 0
  attention_mask (B, L) int64, 1 on real tokens
  position_ids   (B, L) int64, 0..len-1 on real tokens, 0 on padding
  response_mask  (B, L) float32, 1 at positions holding response tokens the loss trains: every response
                 token, or for a multi-turn sample (``SequenceSample.loss_mask``) only the model's tokens, so
                 observation tokens are outside every loss, KL, entropy, normaliser and critic term
  sample_index   (B,)   int64, index of each row in the input ``samples`` list
  <field>        (B, L) float32 for each per-response-token tensor: the value for response token j of a
                 sample sits at position prompt_len + j (the position of that token in input_ids), 0 elsewhere.

Packing is first-fit-decreasing on sequence length under the cost B * L <= token_budget (a sequence longer
than the budget gets a microbatch of its own). Within a microbatch rows are in input order, and
microbatches are ordered by their smallest sample index, so the result is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SequenceSample:
    prompt_ids: list[int] | torch.Tensor
    response_ids: list[int] | torch.Tensor
    # per-response-token values, each of shape (len(response_ids),): behaviour_logprobs, advantages, ...
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # (len(response_ids),) 0/1: 1 = a model token (trained); None = every response token. Per-sample values
    # read back with packing.rows_by_sample cover the masked tokens only (the model-token subsequence).
    loss_mask: torch.Tensor | None = None


RESERVED_KEYS = frozenset({"input_ids", "attention_mask", "position_ids", "response_mask", "sample_index"})


def _length(sample: SequenceSample) -> int:
    return len(sample.prompt_ids) + len(sample.response_ids)


def _validate(samples: list[SequenceSample], token_budget: int) -> None:
    if token_budget <= 0:
        raise ValueError(f"token_budget={token_budget} must be > 0; set train.micro_batch_tokens to a positive value")
    if not samples:
        return
    keys = set(samples[0].tensors)
    clash = keys & RESERVED_KEYS
    if clash:
        raise ValueError(f"per-token field names {sorted(clash)} clash with microbatch keys; rename them")
    for i, s in enumerate(samples):
        if len(s.response_ids) == 0:
            raise ValueError(f"sample {i} has an empty response; filter it out before microbatching")
        if set(s.tensors) != keys:
            raise ValueError(f"sample {i} has tensor fields {sorted(s.tensors)} but sample 0 has {sorted(keys)}; "
                             "every sample must carry the same per-token fields")
        if s.loss_mask is not None:
            if s.loss_mask.dim() != 1 or s.loss_mask.shape[0] != len(s.response_ids):
                raise ValueError(f"sample {i} loss_mask has shape {tuple(s.loss_mask.shape)}; expected "
                                 f"({len(s.response_ids)},), one value per response token")
            if not bool(s.loss_mask.bool().any()):
                raise ValueError(f"sample {i} has no model token (its loss_mask is all 0); filter it out before microbatching")
        for name, t in s.tensors.items():
            if t.dim() != 1 or t.shape[0] != len(s.response_ids):
                raise ValueError(f"sample {i} field '{name}' has shape {tuple(t.shape)}; expected "
                                 f"({len(s.response_ids)},), one value per response token")


def pack_indices(lengths: list[int], token_budget: int) -> list[list[int]]:
    """First-fit-decreasing bins of indices with len(bin) * max_len(bin) <= token_budget.

    Ties in length are broken by index so the result is deterministic. Bins are returned ordered by
    their smallest index, each bin sorted ascending.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    widths: list[int] = []  # the first (longest) length in each bin, i.e. its L
    for i in order:
        for b, members in enumerate(bins):
            if (len(members) + 1) * widths[b] <= token_budget:
                members.append(i)
                break
        else:
            bins.append([i])
            widths.append(lengths[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def _as_long(ids: list[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(ids, dtype=torch.long).reshape(-1)


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids (B, L) int64, right-padded with ``pad_id`` to the longest of ``seqs``, and attention_mask (B, L)
    int64, 1 on real tokens: the plain batch of a scoring or warm-up forward (no microbatch fields)."""
    length = max(len(s) for s in seqs)
    ids_BL = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask_BL = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids_BL[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask_BL[i, : len(s)] = 1
    return ids_BL, mask_BL


def collate(samples: list[SequenceSample], indices: list[int]) -> dict[str, torch.Tensor]:
    """Right-padded (B, L) tensors for ``samples[i] for i in indices`` (see the module docstring)."""
    rows = [samples[i] for i in indices]
    B, L = len(rows), max(_length(s) for s in rows)
    input_ids = torch.zeros(B, L, dtype=torch.long)
    attention_mask = torch.zeros(B, L, dtype=torch.long)
    position_ids = torch.zeros(B, L, dtype=torch.long)
    response_mask = torch.zeros(B, L, dtype=torch.float32)
    fields = {name: torch.zeros(B, L, dtype=torch.float32) for name in rows[0].tensors}
    for b, s in enumerate(rows):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[b, : p + r] = torch.cat([_as_long(s.prompt_ids), _as_long(s.response_ids)])
        attention_mask[b, : p + r] = 1
        position_ids[b, : p + r] = torch.arange(p + r)
        response_mask[b, p : p + r] = 1.0 if s.loss_mask is None else s.loss_mask.to(torch.float32)
        for name, t in s.tensors.items():
            fields[name][b, p : p + r] = t.to(torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "response_mask": response_mask, "sample_index": torch.tensor(indices, dtype=torch.long), **fields}


def make_microbatches(samples: list[SequenceSample], token_budget: int) -> list[dict[str, torch.Tensor]]:
    """Pack whole sequences into microbatches of at most ``token_budget`` padded tokens (B * L)."""
    _validate(samples, token_budget)
    bins = pack_indices([_length(s) for s in samples], token_budget)
    return [collate(samples, b) for b in bins]


def padding_microbatch(field_names: list[str] | tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """A (1, 2) microbatch with no response tokens, for a rank that has fewer microbatches than its peers:
    every rank must run the same number of forward_backward calls. Its masked loss is 0 and its
    sample_index is -1."""
    mb = collate([SequenceSample([0], [0], {n: torch.zeros(1) for n in field_names})], [0])
    mb["response_mask"].zero_()
    mb["sample_index"].fill_(-1)
    return mb
