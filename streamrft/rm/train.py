"""RM training loops (one process): scalar RMs on preference pairs, generative judges on judgments.

SRM: each step takes ``train.batch_size`` pairs, scores chosen and rejected in one forward (2B rows),
and minimises the mean of ``PAIR_LOSSES[train.loss]`` over pairs and heads, plus ``train.lm_coef`` times
the next-token loss of the chosen responses (:func:`chosen_lm_loss`, through the backbone's tied LM head)
with AdamW. The auxiliary loss is meant to keep the backbone's knowledge of the right response while its
states learn to score; on the arith SRM (pipelines/srm) it did not help on average over three seeds.
GRM: supervised next-token loss on the judgment tokens only (prompt tokens carry no loss), the same
objective as :mod:`streamrft.learner.sft` with the judge prompt as the prompt.

Both write ``output_dir`` (loadable RM) and ``output_dir/train.jsonl`` (loss and held-out accuracy).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path

import torch

from streamrft.data import DataError
from streamrft.rm.config import RMTrainConfig, media_fields
from streamrft.rm.data import PreferencePair, read_judgments, read_preference_pairs, split_holdout
from streamrft.rm.losses import PAIR_LOSSES
from streamrft.rm.model import ScalarRewardModel

log = logging.getLogger(__name__)


def pair_batch_loss(model: ScalarRewardModel, pairs: list[PreferencePair], loss: str,
                    temperature: float, lm_coef: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, r_chosen (B, H), r_rejected (B, H)) for one batch of pairs.

    With ``lm_coef > 0`` the loss adds ``lm_coef * chosen_lm_loss`` (:func:`chosen_lm_loss`) from the same
    forward, so the backbone keeps predicting the preferred answers while its states learn to score them.
    """
    prompts = [p.prompt for p in pairs] * 2
    responses = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    device = next(model.parameters()).device
    media = [p.media for p in pairs] * 2 if model.media else None
    inputs = {k: v.to(device) for k, v in model.batch_inputs(prompts, responses, media).items()}
    ids_BL, mask_BL = inputs.pop("input_ids"), inputs.pop("attention_mask")
    r_2BH, last_2BLD = model.rewards_and_states(ids_BL, mask_BL, **inputs)
    r_2BH = r_2BH.float()
    r_c, r_r = r_2BH[: len(pairs)], r_2BH[len(pairs):]
    margin_B = torch.tensor([p.margin for p in pairs], device=device)
    tie_B = torch.tensor([p.tie for p in pairs], device=device)
    per_pair = PAIR_LOSSES[loss](r_c, r_r, margin=margin_B, tie=tie_B, temperature=temperature)
    total = per_pair.mean()
    if lm_coef > 0:
        n = len(pairs)
        start_B = response_starts(mask_BL[:n], model.response_token_counts([p.chosen for p in pairs]))
        total = total + lm_coef * chosen_lm_loss(model.lm_logits(last_2BLD[:n]).float(), ids_BL[:n], mask_BL[:n],
                                                 start_B)
    return total, r_c, r_r


def response_starts(mask_BL: torch.Tensor, n_response: list[int]) -> torch.Tensor:
    """Position of each row's first response token: (last non-pad position + 1) - n_response[b].

    Counted back from the row's end, so it holds for right-padded text rows and left-padded media rows alike,
    and the prompt part keeps every token the processor put there (expanded image / video / audio
    placeholders). A tokenizer that merges the prompt's last characters with the response's first (BPE
    across the boundary) makes the first response token that merged token, as it is in the row itself.
    """
    positions_BL = torch.arange(mask_BL.shape[1], device=mask_BL.device).expand_as(mask_BL)
    end_B = torch.where(mask_BL.bool(), positions_BL, -1).max(dim=1).values + 1
    return end_B - torch.tensor(n_response, device=mask_BL.device)


def chosen_lm_loss(logits_BLV: torch.Tensor, ids_BL: torch.Tensor, mask_BL: torch.Tensor,
                   prompt_len_B: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the response tokens (and eos) of each row:

        L = -(1 / N) sum_b sum_{t >= P_b, mask} log p(x_{b,t} | x_{b,<t})

    P_b = the position of row b's first response token (:func:`response_starts`; the prompt length for a
    right-padded row).
    """
    target_BL = ids_BL[:, 1:]
    positions_L = torch.arange(1, ids_BL.shape[1], device=ids_BL.device)
    keep_BL = mask_BL[:, 1:].bool() & (positions_L.unsqueeze(0) >= prompt_len_B.unsqueeze(1))
    nll_BL = torch.nn.functional.cross_entropy(logits_BLV[:, :-1].transpose(1, 2), target_BL, reduction="none")
    return (nll_BL * keep_BL).sum() / keep_BL.sum().clamp(min=1)


@torch.no_grad()
def srm_accuracy(model: ScalarRewardModel, pairs: list[PreferencePair], batch_size: int = 256) -> float:
    """Held-out pairwise accuracy: share of non-tie pairs with reward(chosen) > reward(rejected)."""
    strict = [p for p in pairs if not p.tie]
    if not strict:
        return float("nan")
    media = [p.media for p in strict] if model.media else None
    r_c = model.score([p.prompt for p in strict], [p.chosen for p in strict], batch_size, media)
    r_r = model.score([p.prompt for p in strict], [p.rejected for p in strict], batch_size, media)
    return sum(c > r for c, r in zip(r_c, r_r)) / len(strict)


def lr_factor(schedule: str, step: int, steps: int) -> float:
    """Multiplier of the peak lr at 0-based ``step``: 1 (constant) or (1 + cos(pi * step / steps)) / 2."""
    if schedule == "constant":
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * min(step, steps) / max(1, steps)))


def _split(cfg: RMTrainConfig, reader):
    media = media_fields(cfg.data)
    rows = reader(cfg.data.train_path, media)
    if cfg.data.eval_path:
        return rows, reader(cfg.data.eval_path, media)
    return split_holdout(rows, cfg.data.eval_fraction, cfg.seed)


def _log_record(out: Path, record: dict) -> None:
    with open(out / "train.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def train_srm(cfg: RMTrainConfig) -> dict:
    """Train a ScalarRewardModel per ``cfg``; save it to ``cfg.output_dir``; return the summary."""
    torch.manual_seed(cfg.seed)
    train_pairs, eval_pairs = _split(cfg, read_preference_pairs)
    model = ScalarRewardModel.from_backbone(cfg.model.path, cfg.model.layer, cfg.model.pooling, cfg.model.num_heads,
                                            media=media_fields(cfg.data))
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.jsonl").unlink(missing_ok=True)
    t = cfg.train
    optim = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optim, lambda i: lr_factor(t.lr_schedule, i, t.steps))
    rng = random.Random(cfg.seed)
    start = time.perf_counter()
    model.train()
    losses: list[float] = []
    for step in range(1, t.steps + 1):
        batch = [train_pairs[rng.randrange(len(train_pairs))] for _ in range(t.batch_size)]
        loss, _, _ = pair_batch_loss(model, batch, t.loss, t.temperature, t.lm_coef)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optim.step()
        schedule.step()
        losses.append(loss.item())
        if t.log_every and (step % t.log_every == 0 or step == t.steps):
            record = {"step": step, "loss": sum(losses[-t.log_every:]) / len(losses[-t.log_every:]),
                      "seconds": round(time.perf_counter() - start, 2)}
            _log_record(out, record)
            log.info("train-rm step %d/%d loss %.4f", step, t.steps, record["loss"])
    accuracy = srm_accuracy(model, eval_pairs)
    model.save_pretrained(out)
    summary = {"kind": "srm", "steps": t.steps, "final_loss": losses[-1] if losses else float("nan"),
               "eval_pairwise_accuracy": accuracy, "n_train": len(train_pairs), "n_eval": len(eval_pairs),
               "seconds": round(time.perf_counter() - start, 2), "output_dir": str(out)}
    _log_record(out, summary)
    return summary


def train_grm(cfg: RMTrainConfig) -> dict:
    """Fine-tune a GenerativeJudge per ``cfg`` (loss on the judgment tokens); save; return the summary."""
    from streamrft.learner.sft import supervised_warmup
    from streamrft.rm.judge import GenerativeJudge, judge_accuracy, train_media_judge

    torch.manual_seed(cfg.seed)
    train_rows, eval_rows = _split(cfg, read_judgments)
    sizes = {len(r.responses) for r in train_rows + eval_rows}
    if len(sizes) != 1:
        raise DataError(f"{cfg.data.train_path}: rows mix 1 and 2 responses; a judge is either pairwise (2) or "
                        "pointwise (1), split the file")
    judge = GenerativeJudge.from_base(cfg.model.path, cfg.grm, "pairwise" if sizes == {2} else "pointwise",
                                      media_fields(cfg.data))
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.jsonl").unlink(missing_ok=True)
    start = time.perf_counter()
    t = cfg.train
    if judge.media:
        losses = train_media_judge(judge, train_rows, steps=t.steps, lr=t.lr, batch_size=t.batch_size, seed=cfg.seed,
                                   log_every=t.log_every)
    else:
        sft_rows = [{"prompt": judge.judge_prompt(r.prompt, r.responses), "reference": r.judgment} for r in train_rows]
        losses = supervised_warmup(judge.model, judge.tokenizer, sft_rows, steps=t.steps, lr=t.lr,
                                   batch_size=t.batch_size, seed=cfg.seed, log_every=t.log_every)
    for i in range(t.log_every - 1 if t.log_every else len(losses), len(losses), t.log_every or 1):
        window = losses[max(0, i + 1 - t.log_every): i + 1]
        _log_record(out, {"step": i + 1, "loss": sum(window) / len(window)})
    accuracy = judge_accuracy(judge, eval_rows)
    judge.save_pretrained(out)
    summary = {"kind": "grm", "steps": t.steps, "final_loss": losses[-1] if losses else float("nan"),
               "eval_verdict_accuracy": accuracy, "n_train": len(train_rows), "n_eval": len(eval_rows),
               "seconds": round(time.perf_counter() - start, 2), "output_dir": str(out)}
    _log_record(out, summary)
    return summary


TRAINERS = {"srm": train_srm, "grm": train_grm}  # RM config `kind` -> training loop
