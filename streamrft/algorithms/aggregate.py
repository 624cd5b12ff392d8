"""Loss aggregation with global normalisers, so microbatches and ranks add up to the whole batch.

For a step batch split into microbatches (and ranks), sum over microbatches of aggregate_loss(mb) equals
aggregate_loss(whole batch), because each mode is a sum over tokens or sequences divided by a count of
the WHOLE step batch that the caller passes in (n_tokens_global, n_seqs_global). Modes, with m the mask:

  token-mean               sum_{i,t} m L / n_tokens_global
  seq-mean-token-mean      sum_i [sum_t m L / sum_t m] / n_seqs_global
  seq-mean-token-sum       sum_i sum_t m L / n_seqs_global
  seq-mean-token-sum-norm  sum_i sum_t m L / max_response_len / n_seqs_global  (Dr. GRPO, arXiv:2503.20783)

Empty sequences contribute 0; a fully masked microbatch gives exactly 0 (never nan), and a zero global
count is treated as 1 (the sum is 0 then anyway).
"""

from __future__ import annotations

from torch import Tensor

from streamrft.algorithms._masked import mask_out

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def aggregate_loss(
    loss_BT: Tensor,
    mask_BT: Tensor,
    mode: str,
    n_tokens_global: float,
    n_seqs_global: float,
    max_response_len: int,
) -> Tensor:
    """Scalar loss of one microbatch, normalised by the whole step batch's counts (see module doc)."""
    masked_BT = mask_out(loss_BT, mask_BT)
    if mode == "token-mean":
        return masked_BT.sum() / max(float(n_tokens_global), 1.0)
    seq_sum_B = masked_BT.sum(dim=1)
    if mode == "seq-mean-token-mean":
        per_seq_B = seq_sum_B / mask_BT.sum(dim=1).clamp(min=1).to(seq_sum_B.dtype)
    elif mode == "seq-mean-token-sum":
        per_seq_B = seq_sum_B
    elif mode == "seq-mean-token-sum-norm":
        per_seq_B = seq_sum_B / float(max_response_len)
    else:
        raise ValueError(f"algorithm.loss_agg_mode={mode!r}: choose one of {', '.join(LOSS_AGG_MODES)}")
    return per_seq_B.sum() / max(float(n_seqs_global), 1.0)
