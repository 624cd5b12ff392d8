"""Pieces shared by prepare.py and train.py: batched inputs, greedy accuracy."""

from __future__ import annotations

import asyncio

import torch

from streamrft.config.engine import EngineConfig
from streamrft.engines.base import GenerationRequest
from streamrft.engines.hf import HFEngine
from pipelines.common import media_prompt_inputs
from pipelines.visual_count.task import PROMPT, reward


def prompt_inputs(processor, examples) -> list[dict]:
    return media_prompt_inputs(processor, PROMPT, "images", examples)


def generate(engine: HFEngine, inputs: list[dict], n: int, seed: int):
    """n samples per prompt; returns (samples in order, prompt index of each)."""
    reqs, mm, index = [], {}, []
    for i, x in enumerate(inputs):
        for j in range(n):
            rid = f"p{i}-s{j}"
            reqs.append(GenerationRequest(rid, x["input_ids"][0].tolist(), seed=seed * 100003 + i * 97 + j))
            mm[rid] = x
            index.append(i)
    return asyncio.run(engine.generate_all(reqs, mm)), index


def accuracy(model, processor, examples, max_new_tokens: int = 2) -> float:
    engine = HFEngine(model, EngineConfig(top_k=1, max_new_tokens=max_new_tokens), [processor.tokenizer.eos_token_id],
                      processor.tokenizer.pad_token_id, torch.device("cpu"))
    samples, index = generate(engine, prompt_inputs(processor, examples), 1, 0)
    tok = processor.tokenizer
    return sum(reward(tok.decode(s.response_ids, skip_special_tokens=True), examples[i][1])
               for s, i in zip(samples, index)) / len(examples)
