"""Sample packing: several sequences concatenated into one row, attending only within themselves.

A packed microbatch has the keys of ``microbatch.make_microbatches`` with B = 1 row per microbatch:
  input_ids      (1, L) int64, sequence after sequence, right-padded with 0 up to L
  attention_mask (1, 1, L, L) bool, block-diagonal causal: token q may attend to token k iff both lie in
                 the same sequence and k <= q (a padding token attends only to itself, so no row is empty)
  position_ids   (1, L) int64, restarting at 0 at the start of every sequence (0 on padding)
  response_mask  (1, L) float32, 1 at positions holding response tokens (the model's only, with a loss_mask)
  sample_index   (S,) int64, the samples of the row, in the order they were concatenated
  <field>        (1, L) float32, per-response-token values at the position of their token
and one key more, ``seq_index`` (1, L) int64: the index (into ``samples``) of the sequence each token
belongs to, -1 on padding; ``rows_by_sample`` reads per-sample values back from either layout.

Why the result equals the unpadded computation: with per-sequence position ids (RoPE sees 0..n-1) and a
block-diagonal causal mask, every token's attention sums over exactly the keys it would see alone, so
hidden states, log-probs, losses and gradients equal those of ``make_microbatches`` up to float
reassociation (tests check 1e-5 in float32). ``logprobs.token_logprobs`` turns the 4-D mask into what the
attention implementation wants (bool for sdpa, additive for eager; for flash_attention_2 it passes no
mask and transformers runs varlen flash attention from the restarting position ids).

Bins: each microbatch holds at most ``token_budget`` real tokens (a longer sequence gets a bin of its own).
First-fit-decreasing fixes the number of bins k; the sequences are then dealt longest first to the
least-loaded bin they fit in (LPT, Graham 1969), which balances the token counts across the k bins.
The mask costs L^2 bytes per microbatch (64 MiB at L = 8192).
"""

from __future__ import annotations

import torch

from streamrft.learner.microbatch import SequenceSample, _as_long, _length, _validate


def first_fit_decreasing(lengths: list[int], token_budget: int) -> int:
    """The number of bins first-fit-decreasing needs with capacity ``token_budget`` tokens per bin."""
    loads: list[int] = []
    for n in sorted(lengths, reverse=True):
        for b, load in enumerate(loads):
            if load + n <= token_budget:
                loads[b] += n
                break
        else:
            loads.append(n)
    return len(loads)


def balanced_bins(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Bins of indices, each summing to <= token_budget (or one over-long sequence), balanced by tokens.

    k = first_fit_decreasing(...) bins; indices are placed longest first (ties by index) into the
    least-loaded bin with room (ties by bin number), opening a new bin when none has room. Bins are
    returned ordered by their smallest index, each sorted ascending: the result is deterministic."""
    k = first_fit_decreasing(lengths, token_budget)
    bins: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b in range(len(bins)) if loads[b] + lengths[i] <= token_budget]
        if fits:
            b = min(fits, key=lambda b: (loads[b], b))
        else:
            empty = [b for b in range(len(bins)) if not bins[b]]
            b = empty[0] if empty else len(bins)
            if b == len(bins):
                bins.append([])
                loads.append(0)
        bins[b].append(i)
        loads[b] += lengths[i]
    return sorted((sorted(b) for b in bins if b), key=lambda b: b[0])


def block_causal_mask(seq_index_L: torch.Tensor) -> torch.Tensor:
    """(1, 1, L, L) bool: q attends k iff same sequence and k <= q; padding (-1) attends only to itself."""
    L = seq_index_L.shape[0]
    same_LL = seq_index_L[:, None] == seq_index_L[None, :]
    causal_LL = torch.ones(L, L, dtype=torch.bool).tril()
    pad_L = seq_index_L < 0
    mask_LL = same_LL & causal_LL & ~(pad_L[:, None] | pad_L[None, :])
    mask_LL |= torch.eye(L, dtype=torch.bool) & pad_L[:, None]
    return mask_LL[None, None]


def collate_packed(samples: list[SequenceSample], indices: list[int], pad_to: int = 0) -> dict[str, torch.Tensor]:
    """One packed row for ``samples[i] for i in indices`` (see the module docstring); L = max(total, pad_to)."""
    rows = [samples[i] for i in indices]
    L = max(sum(_length(s) for s in rows), pad_to)
    input_ids = torch.zeros(1, L, dtype=torch.long)
    position_ids = torch.zeros(1, L, dtype=torch.long)
    response_mask = torch.zeros(1, L, dtype=torch.float32)
    seq_index = torch.full((1, L), -1, dtype=torch.long)
    fields = {name: torch.zeros(1, L, dtype=torch.float32) for name in rows[0].tensors}
    start = 0
    for idx, s in zip(indices, rows):
        p, r = len(s.prompt_ids), len(s.response_ids)
        end = start + p + r
        input_ids[0, start:end] = torch.cat([_as_long(s.prompt_ids), _as_long(s.response_ids)])
        position_ids[0, start:end] = torch.arange(p + r)
        response_mask[0, start + p:end] = 1.0 if s.loss_mask is None else s.loss_mask.to(torch.float32)
        seq_index[0, start:end] = idx
        for name, t in s.tensors.items():
            fields[name][0, start + p:end] = t.to(torch.float32)
        start = end
    return {"input_ids": input_ids, "attention_mask": block_causal_mask(seq_index[0]),
            "position_ids": position_ids, "response_mask": response_mask,
            "sample_index": torch.tensor(indices, dtype=torch.long), "seq_index": seq_index, **fields}


def make_packed_microbatches(samples: list[SequenceSample], token_budget: int) -> list[dict[str, torch.Tensor]]:
    """Packed microbatches (one row each) of at most ``token_budget`` real tokens, balanced by tokens."""
    _validate(samples, token_budget)
    if samples and "seq_index" in samples[0].tensors:
        raise ValueError("per-token field name 'seq_index' clashes with a packed microbatch key; rename it")
    bins = balanced_bins([_length(s) for s in samples], token_budget)
    return [collate_packed(samples, b) for b in bins]


def rows_by_sample(mb: dict[str, torch.Tensor], key: str) -> dict[int, torch.Tensor]:
    """{sample index: that sample's response values of field ``key``} for a packed or unpacked microbatch
    (padding microbatches, sample_index -1, give nothing)."""
    out: dict[int, torch.Tensor] = {}
    resp_BL = mb["response_mask"].bool()
    if "seq_index" in mb:
        for idx in mb["sample_index"].tolist():
            sel_BL = resp_BL & (mb["seq_index"] == idx)
            out[idx] = mb[key][sel_BL].float()
        return out
    for i, idx in enumerate(mb["sample_index"].tolist()):
        if idx >= 0:
            out[idx] = mb[key][i][resp_BL[i]].float()
    return out


def scatter_by_sample(mb: dict[str, torch.Tensor], key: str, rows: list[torch.Tensor]) -> None:
    """Write ``rows[idx]`` (one value per response token of sample idx) into mb[key], either layout."""
    field = torch.zeros_like(mb["response_mask"], dtype=torch.float32)
    resp_BL = mb["response_mask"].bool()
    if "seq_index" in mb:
        for idx in mb["sample_index"].tolist():
            field[resp_BL & (mb["seq_index"] == idx)] = rows[idx].float()
    else:
        for i, idx in enumerate(mb["sample_index"].tolist()):
            if idx >= 0:
                field[i][resp_BL[i]] = rows[idx].float()
    mb[key] = field


def n_sequences(mb: dict[str, torch.Tensor]) -> int:
    """Real sequences in a packed or unpacked microbatch."""
    return int((mb["sample_index"] >= 0).sum())
