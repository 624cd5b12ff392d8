"""Run a policy on a benchmark: n samples per problem with the HFEngine, then pass@1 / pass@k / maj@k.

Per-problem results go to ``output_path`` (jsonl, one row per problem: index, prompt, reference,
responses, answers, correct, n_correct, pass@1, pass@k, maj_answer, maj@k) and the summary (the mean
of each metric over problems) to ``<output_path>.summary.json``.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from streamrft.data import DataError, read_rows
from streamrft.data.chat import check_messages, is_messages, prompt_ids
from streamrft.data.formats import get_field
from streamrft.evaluate.answers import FORMATS
from streamrft.evaluate.config import EvalConfig, check_prompt_lengths
from streamrft.evaluate.metrics import majority_answer, pass_at_k


def load_problems(cfg: EvalConfig) -> list[tuple[str | list, str]]:
    """(prompt, reference) of every row (a prompt is text or chat messages; keys may be dotted paths such as
    reward_model.ground_truth); DataError naming file, row and field when one is missing."""
    problems = []
    for i, row in enumerate(read_rows(cfg.data_path)):
        for key, name in ((cfg.prompt_key, "prompt_key"), (cfg.reference_key, "reference_key")):
            value = get_field(row, key, None)
            if key == cfg.prompt_key and is_messages(value):
                check_messages(value, f"{cfg.data_path}: row {i} field {key!r}")
            elif not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise DataError(f"{cfg.data_path}: row {i}: missing field {key!r} (set {name} to the field "
                                f"that holds it; row keys: {sorted(row)})")
        prompt = get_field(row, cfg.prompt_key)
        if cfg.system_prompt and not is_messages(prompt):
            raise DataError(f"{cfg.data_path}: row {i} field {cfg.prompt_key!r} is text but system_prompt is set; a "
                            "system prompt applies to message-list prompts: clear system_prompt or give messages")
        problems.append((prompt if is_messages(prompt) else str(prompt), str(get_field(row, cfg.reference_key))))
        if cfg.limit and len(problems) == cfg.limit:
            break
    if not problems:
        raise DataError(f"{cfg.data_path}: no rows")
    return problems


def score_problem(responses: list[str], reference: str, fmt: str, k: int) -> dict:
    """Answers, correctness and the per-problem metrics for the n responses of one problem."""
    f = FORMATS[fmt]
    answers = [f.extract(r) for r in responses]
    correct = [a is not None and f.check(a, reference) for a in answers]
    n, c = len(responses), sum(correct)
    maj = majority_answer(answers[:k])
    return {"answers": answers, "correct": correct, "n_correct": c, "pass@1": c / n,
            "pass@k": pass_at_k(n, c, k), "maj_answer": maj, "maj@k": float(maj is not None and f.check(maj, reference))}


def evaluate(cfg: EvalConfig) -> dict:
    """Sample, score and write results; returns the summary."""
    from streamrft.config.engine import EngineConfig
    from streamrft.engines.base import GenerationRequest
    from streamrft.engines.hf import HFEngine
    from streamrft.models.tiny import load_policy

    from transformers import AutoTokenizer

    problems = load_problems(cfg)
    # Tokenize first, with the tokenizer alone: a prompt that cannot fit is an error before the model loads.
    from streamrft.models.hub import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(cfg.model_path, "model_path"))
    # text prompts: prompt_template, tokenized as before; message lists: the training run's chat rendering
    all_ids = [tokenizer(cfg.prompt_template.format(prompt=prompt))["input_ids"] if not is_messages(prompt) else
               prompt_ids(tokenizer, prompt, cfg.chat_template, cfg.system_prompt,
                          f"{cfg.data_path}: row {i} field {cfg.prompt_key!r}")[1]
               for i, (prompt, _) in enumerate(problems)]
    check_prompt_lengths(cfg, [len(ids) for ids in all_ids])
    model, tokenizer = load_policy(cfg.model_path)
    model.eval()
    engine_cfg = EngineConfig(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                              max_batch_size=cfg.max_batch_size)
    engine = HFEngine(model, engine_cfg, [tokenizer.eos_token_id], tokenizer.pad_token_id, "cpu")
    requests = []
    for i, ids in enumerate(all_ids):
        requests += [GenerationRequest(f"{i}:{j}", ids, seed=cfg.seed * 1_000_003 + i * cfg.n + j) for j in range(cfg.n)]
    start = time.perf_counter()
    samples = {s.request_id: s for s in asyncio.run(engine.generate_all(requests))}
    seconds = time.perf_counter() - start
    out = Path(cfg.output_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    totals = {"pass@1": 0.0, "pass@k": 0.0, "maj@k": 0.0}
    with open(out, "w") as f:
        for i, (prompt, reference) in enumerate(problems):
            responses = [tokenizer.decode(samples[f"{i}:{j}"].response_ids, skip_special_tokens=True) for j in range(cfg.n)]
            row = {"index": i, "prompt": prompt, "reference": reference, "responses": responses,
                   **score_problem(responses, reference, cfg.format, cfg.k)}
            for key in totals:
                totals[key] += row[key]
            f.write(json.dumps(row) + "\n")
    m = len(problems)
    summary = {"pass@1": totals["pass@1"] / m, f"pass@{cfg.k}": totals["pass@k"] / m,
               f"maj@{cfg.k}": totals["maj@k"] / m, "n_problems": m, "n": cfg.n, "k": cfg.k,
               "format": cfg.format, "seconds": round(seconds, 2), "output_path": str(out)}
    Path(f"{out}.summary.json").write_text(json.dumps(summary, indent=2))
    return summary
