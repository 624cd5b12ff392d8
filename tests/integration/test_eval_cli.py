"""`streamrft eval` on the tiny arith policy: reported metrics equal counts from the written results."""

from __future__ import annotations

import json
from math import comb

import pytest

from streamrft.evaluate.cli import eval_main

pytestmark = pytest.mark.slow


def test_reported_pass_and_maj_at_k_equal_a_direct_count_of_the_written_results(arith_dir, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    n, k = 6, 3
    rc = eval_main(["--model", str(arith_dir / "sft"), "--data", str(arith_dir / "eval.jsonl"), "--n", str(n),
                    "--k", str(k), "--format", "arith", "--max-new-tokens", "6", "--limit", "24",
                    "--output", str(out), "--seed", "1"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == summary["n_problems"] == 24
    pass_k, maj_k, pass_1 = [], [], []
    for row in rows:
        correct = [r.strip() == row["reference"] for r in row["responses"]]  # exact match, counted here
        assert correct == row["correct"]
        c = sum(correct)
        pass_1.append(c / n)
        pass_k.append(1 - comb(n - c, k) / comb(n, k))
        votes = [r.strip() for r in row["responses"][:k]]
        top = max(votes, key=lambda v: (votes.count(v), -votes.index(v)))
        maj_k.append(float(top == row["reference"]))
    assert summary["pass@1"] == pytest.approx(sum(pass_1) / len(rows), abs=1e-12)
    assert summary[f"pass@{k}"] == pytest.approx(sum(pass_k) / len(rows), abs=1e-12)
    assert summary[f"maj@{k}"] == pytest.approx(sum(maj_k) / len(rows), abs=1e-12)
    assert 0 < summary["pass@1"] < summary[f"pass@{k}"]  # sampling varies, so pass@k rises above pass@1
    assert json.loads((tmp_path / "results.jsonl.summary.json").read_text()) == summary


def test_a_benchmark_row_without_the_reference_field_is_named(arith_dir, tmp_path, capsys):
    data = tmp_path / "bench.jsonl"
    data.write_text('{"prompt": "1+1=", "reference": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    rc = eval_main(["--model", str(arith_dir / "sft"), "--data", str(data), "--n", "1", "--k", "1",
                    "--format", "arith", "--output", str(tmp_path / "r.jsonl")])
    assert rc == 2
    assert (f"{data}: row 1: missing field 'reference' (set reference_key to the field that holds it; "
            "row keys: ['answer', 'prompt'])") in capsys.readouterr().err
