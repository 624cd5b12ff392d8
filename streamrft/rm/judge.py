"""GenerativeJudge: a causal LM fine-tuned to write a verdict, parsed into a preference or a score.

The judge reads ``template`` (two responses: ``{prompt}``, ``{a}``, ``{b}``) or ``single_template``
(one response: ``{prompt}``, ``{a}``) and greedily writes a verdict. :func:`parse_verdict` reads the
last ``[[...]]`` in it: ``[[A]]`` / ``[[B]]`` (A or B is better), ``[[C]]`` or ``[[tie]]`` (a tie),
or ``[[x]]`` with x a number (a score).

As a reward (:class:`streamrft.rm.reward.ModelReward`) a judge trained on pairs compares the response
(A) with the item's reference (B): reward 1.0 for ``[[A]]``, 0.5 for a tie, 0.0 for ``[[B]]``; a judge
trained on single responses returns the score. A verdict that does not parse fails that sample.

A saved judge directory is the LM (``save_pretrained``), its tokenizer and ``rm.json``
(``{"kind": "grm", "mode": "pairwise" | "pointwise", "template", "single_template", "max_new_tokens"}``).
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
from streamrft.rm.model import RM_META, rm_kind

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
    def __init__(self, model: torch.nn.Module, tokenizer, cfg: GRMConfig, mode: str = "pairwise") -> None:
        if mode not in ("pairwise", "pointwise"):
            raise ValueError(f"judge mode={mode!r} must be 'pairwise' or 'pointwise'")
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.mode = mode

    @classmethod
    def from_base(cls, path: str, cfg: GRMConfig, mode: str = "pairwise") -> "GenerativeJudge":
        from streamrft.models.tiny import load_policy

        model, tokenizer = load_policy(path)
        judge = cls(model, tokenizer, cfg, mode)
        judge.check_tokenizer()
        return judge

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu") -> "GenerativeJudge":
        kind = rm_kind(path)
        if kind != "grm":
            raise ValueError(f"{path} holds a {kind!r} reward model, not a generative judge ('grm'); "
                             "load it with ScalarRewardModel.from_pretrained")
        from streamrft.models.tiny import load_policy

        meta = json.loads((Path(path) / RM_META).read_text())
        cfg = GRMConfig(template=meta["template"], single_template=meta["single_template"],
                        max_new_tokens=meta["max_new_tokens"])
        model, tokenizer = load_policy(str(path), device=device)
        return cls(model.eval(), tokenizer, cfg, meta["mode"])

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        meta = {"kind": "grm", "mode": self.mode, "template": self.cfg.template,
                "single_template": self.cfg.single_template, "max_new_tokens": self.cfg.max_new_tokens}
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

    def generate(self, judge_prompts: Sequence[str], batch_size: int = 256) -> list[str]:
        """Greedy verdict text for every judge prompt."""
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

    def rewards(self, prompts: Sequence[str], responses: Sequence[str], references: Sequence[str]) -> list[float | Exception]:
        """One reward per response (see the module docstring); a ValueError where the verdict does not parse."""
        if self.mode == "pairwise":
            texts = self.generate([self.judge_prompt(p, [r, ref]) for p, r, ref in zip(prompts, responses, references)])
            table = {"A": 1.0, "tie": 0.5, "B": 0.0}
        else:
            texts = self.generate([self.judge_prompt(p, [r]) for p, r in zip(prompts, responses)])
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
    texts = judge.generate([judge.judge_prompt(r.prompt, r.responses) for r in rows])
    return sum(parse_verdict(t) is not None and parse_verdict(t) == parse_verdict(r.judgment)
               for t, r in zip(texts, rows)) / len(rows)
