"""GenerativeJudge: a causal LM fine-tuned to write a verdict, parsed into a preference or a score.

The judge reads ``template`` (two responses: ``{prompt}``, ``{a}``, ``{b}``) or ``single_template``
(one response: ``{prompt}``, ``{a}``) and greedily writes a verdict. :func:`parse_verdict` reads the
last ``[[...]]`` in it: ``[[A]]`` / ``[[B]]`` (A or B is better), ``[[C]]`` or ``[[tie]]`` (a tie),
or ``[[x]]`` with x a number (a score).

As a reward (:class:`streamrft.rm.reward.ModelReward`) a judge trained on pairs compares the response
(A) with the item's reference (B): reward 1.0 for ``[[A]]``, 0.5 for a tie, 0.0 for ``[[B]]``; a judge
trained on single responses returns the score. A verdict that does not parse fails that sample.

A saved judge directory is the LM (``save_pretrained``), its tokenizer and ``rm.json``
(``{"kind": "grm", "mode": "pairwise" | "pointwise", "template", "single_template", "max_new_tokens", "media"}``).

Media: with media fields (``media``, streamrft.rm.config.media_fields) the judge is a Qwen2-VL / Qwen2-Audio
model that reads the prompt's media (placeholders prepended to the judge prompt, as in RL) and is
fine-tuned by :func:`train_media_judge` (next-token loss on the judgment tokens, the same objective as the
text warm-up); verdicts are greedy (:meth:`GenerativeJudge.generate`, full forward per token: verdicts are
a few tokens long).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Sequence

import torch

from streamrft.rm.config import GRMConfig
from streamrft.rm.data import JudgmentRow
from streamrft.rm.model import RM_META, MediaInputs, has_media, rm_kind

_VERDICT_RE = re.compile(r"\[\[([^\[\]]+)\]\]")


def parse_verdict(text: str) -> str | float | None:
    """``"A"``, ``"B"``, ``"tie"``, a float score, or None when ``text`` holds no ``[[...]]`` verdict."""
    found = _VERDICT_RE.findall(text)
    if not found:
        return None
    v = found[-1].strip()
    if v.upper() in ("A", "B"):
        return v.upper()
    if v.upper() in ("C", "TIE"):
        return "tie"
    try:
        return float(v)
    except ValueError:
        return None


class GenerativeJudge:
    def __init__(self, model: torch.nn.Module, tokenizer, cfg: GRMConfig, mode: str = "pairwise",
                 processor=None, media: dict | None = None) -> None:
        if mode not in ("pairwise", "pointwise"):
            raise ValueError(f"judge mode={mode!r} must be 'pairwise' or 'pointwise'")
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.mode = mode
        self.processor = processor
        self.media = dict(media) if has_media(media) else None
        self.media_inputs = MediaInputs(processor, self.media) if self.media else None

    @classmethod
    def _load(cls, path: str, cfg: GRMConfig, mode: str, media: dict | None,
              device: torch.device | str = "cpu") -> "GenerativeJudge":
        if has_media(media):
            from streamrft.models.multimodal import load_multimodal_policy

            model, processor, kind = load_multimodal_policy(path, device=device)
            if kind == "text":
                raise ValueError(f"{path} is a text-only model but the judge reads media ({media}); give a "
                                 "Qwen2-VL or Qwen2-Audio model.path")
            return cls(model, processor.tokenizer, cfg, mode, processor, media)
        from streamrft.models.tiny import load_policy

        model, tokenizer = load_policy(path, device=device)
        return cls(model, tokenizer, cfg, mode)

    @classmethod
    def from_base(cls, path: str, cfg: GRMConfig, mode: str = "pairwise", media: dict | None = None) -> "GenerativeJudge":
        judge = cls._load(path, cfg, mode, media)
        judge.check_tokenizer()
        return judge

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu") -> "GenerativeJudge":
        kind = rm_kind(path)
        if kind != "grm":
            raise ValueError(f"{path} holds a {kind!r} reward model, not a generative judge ('grm'); "
                             "load it with ScalarRewardModel.from_pretrained")
        meta = json.loads((Path(path) / RM_META).read_text())
        cfg = GRMConfig(template=meta["template"], single_template=meta["single_template"],
                        max_new_tokens=meta["max_new_tokens"])
        judge = cls._load(str(path), cfg, meta["mode"], meta.get("media"), device)
        judge.model.eval()
        return judge

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        (self.processor or self.tokenizer).save_pretrained(path)
        meta = {"kind": "grm", "mode": self.mode, "template": self.cfg.template,
                "single_template": self.cfg.single_template, "max_new_tokens": self.cfg.max_new_tokens,
                "media": self.media}
        (path / RM_META).write_text(json.dumps(meta))

    def check_tokenizer(self) -> None:
        """ValueError when the tokenizer cannot spell the templates or verdicts (a char tokenizer drops
        characters outside its alphabet, which would silently change what the judge reads)."""
        filled = (self.cfg.template.format(prompt="", a="", b=""), self.cfg.single_template.format(prompt="", a=""))
        for text in (*filled, "[[A]][[B]]"):
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            back = self.tokenizer.decode(ids)
            if back != text:
                raise ValueError(f"the tokenizer cannot spell {text!r} (decodes as {back!r}); use a template "
                                 "of characters it knows (grm.template / grm.single_template) or a wider alphabet")

    def judge_prompt(self, prompt: str, responses: Sequence[str]) -> str:
        if len(responses) == 2:
            return self.cfg.template.format(prompt=prompt, a=responses[0], b=responses[1])
        if len(responses) == 1:
            return self.cfg.single_template.format(prompt=prompt, a=responses[0])
        raise ValueError(f"a judgment takes 1 or 2 responses, got {len(responses)}")

    def generate(self, judge_prompts: Sequence[str], batch_size: int = 256,
                 media: Sequence[Sequence] | None = None) -> list[str]:
        """Greedy verdict text for every judge prompt (with its media refs for a media judge)."""
        if self.media_inputs is not None:
            if media is None or len(media) != len(judge_prompts):
                raise ValueError(f"this judge reads media ({self.media}); give one list of media refs per prompt")
            return [text for i in range(0, len(judge_prompts), batch_size)
                    for text in self._greedy_media(judge_prompts[i:i + batch_size], media[i:i + batch_size])]
        from streamrft.config.engine import EngineConfig
        from streamrft.engines.base import GenerationRequest
        from streamrft.engines.hf import HFEngine

        cfg = EngineConfig(top_k=1, max_new_tokens=self.cfg.max_new_tokens, max_batch_size=batch_size)
        device = next(self.model.parameters()).device
        engine = HFEngine(self.model, cfg, [self.tokenizer.eos_token_id], self.tokenizer.pad_token_id, device)
        requests = [GenerationRequest(str(i), self.tokenizer(p, add_special_tokens=False)["input_ids"], seed=i)
                    for i, p in enumerate(judge_prompts)]
        samples = asyncio.run(engine.generate_all(requests))
        return [self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]

    @torch.no_grad()
    def _greedy_media(self, judge_prompts: Sequence[str], media: Sequence[Sequence]) -> list[str]:
        """Greedy decoding of ``max_new_tokens`` for a batch of media prompts (left-padded, explicit M-RoPE /
        1-D positions recomputed over the grown sequence each token); each row's text ends at its eos."""
        from streamrft.models.multimodal import forward_kwargs

        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        try:
            inputs = {k: v.to(device) for k, v in self.media_inputs.batch(
                judge_prompts, media, [f"judge prompt {p[:40]!r}" for p in judge_prompts]).items()}
            new = []
            for _ in range(self.cfg.max_new_tokens):
                logits = self.model(**forward_kwargs(self.model, inputs), use_cache=False).logits[:, -1]
                token_B1 = logits.argmax(dim=-1, keepdim=True)
                new.append(token_B1)
                inputs["input_ids"] = torch.cat([inputs["input_ids"], token_B1], dim=1)
                inputs["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(token_B1)], dim=1)
                if "mm_token_type_ids" in inputs:
                    inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(token_B1)], dim=1)
        finally:
            self.model.train(was_training)
        out = []
        for row in (torch.cat(new, dim=1).tolist() if new else [[] for _ in judge_prompts]):
            if self.tokenizer.eos_token_id in row:
                row = row[:row.index(self.tokenizer.eos_token_id)]
            out.append(self.tokenizer.decode(row, skip_special_tokens=True))
        return out

    def rewards(self, prompts: Sequence[str], responses: Sequence[str], references: Sequence[str],
                media: Sequence[Sequence] | None = None) -> list[float | Exception]:
        """One reward per response (see the module docstring); a ValueError where the verdict does not parse."""
        if self.mode == "pairwise":
            texts = self.generate([self.judge_prompt(p, [r, ref]) for p, r, ref in zip(prompts, responses, references)],
                                  media=media)
            table = {"A": 1.0, "tie": 0.5, "B": 0.0}
        else:
            texts = self.generate([self.judge_prompt(p, [r]) for p, r in zip(prompts, responses)], media=media)
            table = {}
        out: list[float | Exception] = []
        for text in texts:
            v = parse_verdict(text)
            if isinstance(v, float) and self.mode == "pointwise":
                out.append(v)
            elif isinstance(v, str) and v in table:
                out.append(table[v])
            else:
                out.append(ValueError(f"judge verdict {text!r} does not parse as a {self.mode} verdict"))
        return out


def judge_accuracy(judge: GenerativeJudge, rows: Sequence[JudgmentRow]) -> float:
    """Share of rows whose greedy verdict parses to the same verdict as the row's judgment."""
    texts = judge.generate([judge.judge_prompt(r.prompt, r.responses) for r in rows],
                           media=[r.media for r in rows] if judge.media else None)
    return sum(parse_verdict(t) is not None and parse_verdict(t) == parse_verdict(r.judgment)
               for t, r in zip(texts, rows)) / len(rows)


def train_media_judge(judge: GenerativeJudge, rows: Sequence[JudgmentRow], steps: int, lr: float, batch_size: int,
                      seed: int, log_every: int = 50) -> list[float]:
    """Fine-tune a media judge in place: AdamW on random batches, loss = mean next-token NLL of the judgment
    tokens + eos given the judge prompt and its media (prompt tokens carry no loss); returns every step's loss."""
    import logging
    import random

    from streamrft.models.multimodal import response_logprobs_batch

    if not rows:
        raise ValueError("train_media_judge got no rows; give a non-empty data.train_path")
    log = logging.getLogger(__name__)
    device = next(judge.model.parameters()).device
    rng = random.Random(seed)
    optim = torch.optim.AdamW([p for p in judge.model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    eos = judge.tokenizer.eos_token_id
    judge.model.train()
    losses: list[float] = []
    for step in range(steps):
        batch = [rows[rng.randrange(len(rows))] for _ in range(batch_size)]
        prompts = [judge.judge_prompt(r.prompt, r.responses) for r in batch]
        inputs = {k: v.to(device) for k, v in judge.media_inputs.batch(
            prompts, [r.media for r in batch], [f"judge prompt {p[:40]!r}" for p in prompts]).items()}
        targets = [judge.tokenizer(r.judgment, add_special_tokens=False)["input_ids"] + [eos] for r in batch]
        logp_BT, mask_BT = response_logprobs_batch(judge.model, inputs, targets)
        loss = -logp_BT.sum() / mask_BT.sum()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            log.info("train-rm (judge) step %d/%d loss %.4f", step + 1, steps, sum(losses[-log_every:]) / log_every)
    judge.model.eval()
    return losses
