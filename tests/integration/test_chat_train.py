"""Training on datasets in the layouts users already have: TRL conversational rows rendered with the tiny
model's chat template (5 steps, held-out evaluation included), and a verl-layout parquet file with a nested
reward_model.ground_truth (2 steps)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrft.config import load_config
from streamrft.rewards.rules import arith
from tests.integration.conftest import REPO, arith_overrides

pytestmark = pytest.mark.slow
CONFIG = REPO / "pipelines" / "arith" / "config.yaml"


def _arith_alphabet() -> str:
    sys.path.insert(0, str(REPO / "pipelines" / "arith"))
    try:
        from task import ARITH_ALPHABET
    finally:
        sys.path.pop(0)
    return ARITH_ALPHABET


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def chat_model(arith_dir, tmp_path_factory) -> Path:
    """The warmed-up arith policy with the chat tokenizer (role tokens added, embeddings grown)."""
    from streamrft.models.tiny import add_chat_tokens

    return Path(add_chat_tokens(str(arith_dir / "sft"), str(tmp_path_factory.mktemp("chat") / "sft"), _arith_alphabet()))


def _write_trl(src: Path, dst: Path, n: int) -> list[dict]:
    """TRL's conversational prompt-only layout: prompt = messages, the answer in a `solution` column."""
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "solution": r["reference"]} for r in _rows(src)[:n]]
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_trl_conversational_rows_train_five_steps_with_the_chat_template(arith_dir, chat_model, tmp_path):
    from streamrft.compose import train
    from transformers import AutoTokenizer

    train_rows = _write_trl(arith_dir / "train.jsonl", tmp_path / "train.jsonl", 64)
    _write_trl(arith_dir / "eval.jsonl", tmp_path / "eval.jsonl", 16)
    out = tmp_path / "run"
    overrides = arith_overrides(arith_dir, out, "train.max_steps=5", "data.format=trl", "data.eval_size=16",
                                f"model.path={chat_model}", f"data.train_path={tmp_path / 'train.jsonl'}",
                                f"data.eval_path={tmp_path / 'eval.jsonl'}", f"sinks.jsonl={tmp_path / 'traj'}")
    summary = train(load_config(CONFIG, overrides))
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert summary["samples_trained"] == 5 * 8 * 4
    # every trajectory's prompt is the chat rendering of its row, and its ids are apply_chat_template's
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    expected = {tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False): r
                for r in train_rows}
    records = [json.loads(line) for f in sorted((tmp_path / "traj").glob("*.jsonl")) for line in f.read_text().splitlines()]
    assert len(records) == 5 * 8 * 4
    for rec in records:
        row = expected[rec["prompt"]]  # KeyError: a prompt that is not a rendered row
        assert rec["prompt"] == f"<|user|>{row['prompt'][0]['content']}<eos><|assistant|>"
        assert rec["prompt_ids"] == tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)["input_ids"]
        # scored against the `solution` column (the trl preset's reference)
        assert rec["reward"] == arith(rec["response"], row["solution"])
    # held-out evaluation rendered the same way and ran (before training and after)
    heldout = [s for s in steps if "heldout_n" in s or "heldout/n" in s]
    assert heldout, steps[-1].keys()


def test_verl_parquet_with_nested_ground_truth_trains_two_steps(arith_dir, chat_model, tmp_path):
    from streamrft.compose import train

    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": r["prompt"]}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": r["reference"]},
             "extra_info": {"split": "train", "index": i}} for i, r in enumerate(_rows(arith_dir / "train.jsonl")[:64])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    out = tmp_path / "run"
    overrides = arith_overrides(arith_dir, out, "train.max_steps=2", f"model.path={chat_model}",
                                f"data.train_path={tmp_path / 'train.parquet'}", "data.eval_path=",
                                f"sinks.jsonl={tmp_path / 'traj'}")
    overrides.remove("data.eval_size=32")
    summary = train(load_config(CONFIG, overrides))  # data.format=auto detects verl's layout
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert summary["samples_trained"] == 2 * 8 * 4
    records = [json.loads(line) for f in sorted((tmp_path / "traj").glob("*.jsonl")) for line in f.read_text().splitlines()]
    gold = {f"<|user|>{r['prompt'][0]['content']}<eos><|assistant|>": r["reward_model"]["ground_truth"] for r in rows}
    assert len(records) == 2 * 8 * 4
    assert all(rec["reward"] == arith(rec["response"], gold[rec["prompt"]]) for rec in records)
