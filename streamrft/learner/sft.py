"""Supervised warm-up on (prompt, reference) pairs: one process, plain AdamW, loss on the answer only.

For a row with prompt tokens p and answer tokens a = tokenize(reference) + [eos], the loss is the mean
next-token cross-entropy over the answer tokens of the batch:

    L = - (1 / sum_b |a_b|) * sum_b sum_t log p_theta(a_{b,t} | p_b, a_{b,<t})

Prompt tokens and right-padding carry no loss (label -100).
"""

from __future__ import annotations

import logging
import random

import torch
import torch.nn.functional as F

from streamrft.learner.microbatch import right_pad

log = logging.getLogger(__name__)
IGNORE = -100


def build_sft_batch(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids (B, L), attention_mask (B, L), labels (B, L) right-padded; labels are the input ids on
    answer positions (reference + eos) and -100 elsewhere (not yet shifted)."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; the warm-up needs one to teach the model to stop")
    seqs, labels = [], []
    for i, row in enumerate(rows):
        if "prompt" not in row or "reference" not in row:
            raise ValueError(f"warm-up row {i} lacks 'prompt' or 'reference' (keys: {sorted(row)}); "
                             "each row needs both")
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(row["reference"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(prompt + answer)
        labels.append([IGNORE] * len(prompt) + answer)
    length = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids_BL, mask_BL = right_pad(seqs, pad)
    labels_BL = torch.full((len(seqs), length), IGNORE, dtype=torch.long)
    for i, lab in enumerate(labels):
        labels_BL[i, : len(lab)] = torch.tensor(lab)
    return ids_BL, mask_BL, labels_BL


def answer_loss(logits_BLV: torch.Tensor, labels_BL: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of position t's logits against labels[t + 1] over labelled positions."""
    return F.cross_entropy(
        logits_BLV[:, :-1].reshape(-1, logits_BLV.shape[-1]).float(),
        labels_BL[:, 1:].reshape(-1),
        ignore_index=IGNORE,
    )


def supervised_warmup(
    model: torch.nn.Module,
    tokenizer,
    rows: list[dict],
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    log_every: int = 50,
) -> list[float]:
    """Train ``model`` in place for ``steps`` AdamW steps on random batches of ``rows``; returns the
    loss of every step. The module's train/eval mode is restored afterwards."""
    if not rows:
        raise ValueError("supervised_warmup got no rows; set warmup.steps=0 or give a non-empty train set")
    if steps < 0 or batch_size < 1 or lr <= 0:
        raise ValueError(f"warm-up needs steps >= 0, batch_size >= 1, lr > 0; got steps={steps}, "
                         f"batch_size={batch_size}, lr={lr} (set warmup.steps / warmup.batch_size / warmup.lr)")
    device = next(model.parameters()).device
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    was_training = model.training
    model.train()
    losses: list[float] = []
    try:
        for step in range(steps):
            batch = [rows[rng.randrange(len(rows))] for _ in range(batch_size)]
            ids_BL, mask_BL, labels_BL = (t.to(device) for t in build_sft_batch(tokenizer, batch))
            logits_BLV = model(input_ids=ids_BL, attention_mask=mask_BL).logits
            loss = answer_loss(logits_BLV, labels_BL)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if log_every and (step + 1) % log_every == 0:
                log.info("warm-up step %d/%d loss %.4f", step + 1, steps, sum(losses[-log_every:]) / log_every)
    finally:
        model.train(was_training)
    return losses
