"""pipelines/gsm8k: preprocessing GSM8K rows, and the shipped configs load and validate."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from streamrft.config import load_config
from streamrft.rewards.rules import gsm8k
from streamrft.rewards.validate import validate_reward

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "pipelines" / "gsm8k"
FIXTURE = ROOT / "tests" / "fixtures" / "gsm8k_test_sample.jsonl"


def load_preprocess():
    spec = importlib.util.spec_from_file_location("gsm8k_preprocess", PIPELINE / "preprocess.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_preprocess_writes_prompt_reference_label_rows_that_the_rule_accepts(tmp_path):
    out = tmp_path / "data.jsonl"
    assert load_preprocess().preprocess(FIXTURE, out) == 30
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    source = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    assert rows[0]["reference"] == "18" and rows[0]["label"] == "gsm8k"
    assert "####" in rows[0]["prompt"] and source[0]["question"] in rows[0]["prompt"]
    for row, src in zip(rows, source):
        assert gsm8k(src["answer"], row["reference"]) == 1.0


def test_preprocess_reads_parquet_and_honours_limit(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    src = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    out = tmp_path / "out.jsonl"
    assert load_preprocess().preprocess(src, out, limit=5) == 5
    assert len(out.read_text().splitlines()) == 5


def test_a_row_missing_a_field_names_the_file_row_and_field(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + json.dumps({"question": "q2"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl: row 2 has no 'answer'"):
        load_preprocess().preprocess(src, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


def test_preprocess_runs_as_a_script_and_reports_errors_with_status_2(tmp_path):
    out = tmp_path / "out.jsonl"
    ok = subprocess.run([sys.executable, str(PIPELINE / "preprocess.py"), str(FIXTURE), str(out), "--limit", "3"],
                        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "wrote 3 rows" in ok.stdout
    bad = subprocess.run([sys.executable, str(PIPELINE / "preprocess.py"), str(tmp_path / "none.jsonl"), str(out)],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "does not exist" in bad.stderr


@pytest.mark.parametrize("name", ["config.yaml", "config_tiny.yaml"])
def test_the_shipped_gsm8k_configs_load_and_their_reward_section_validates(name):
    cfg = load_config(PIPELINE / name)
    validate_reward(cfg)
    assert [s.fn for s in cfg.reward.sources][0] == "gsm8k"
