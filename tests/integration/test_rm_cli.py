"""`streamrft train-rm` / `eval-rm` on tiny data, and a trained RM served by `serve-reward --fn model:DIR`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from pipelines.arith.task import ARITH_ALPHABET
from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2
from streamrft.rm.cli import eval_rm_main, train_rm_main
from tests.integration.conftest import REPO
from tests.ports import free_port

pytestmark = pytest.mark.slow


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def trained_srm(tmp_path_factory):
    """A tiny SRM trained for a few steps with `train-rm` (config + overrides)."""
    root = tmp_path_factory.mktemp("srm")
    tok = build_char_tokenizer(str(root / "base"), ARITH_ALPHABET)
    build_tiny_qwen2(str(root / "base"), tok, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                     intermediate_size=32)
    rows = [{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a + 2)} for a in range(40)]
    rows[3]["tie"] = True
    write(root / "pairs.jsonl", rows)
    (root / "rm.yaml").write_text(f"kind: srm\nmodel:\n  path: {root / 'base'}\ndata:\n  train_path: {root / 'pairs.jsonl'}\n")
    rc = train_rm_main([str(root / "rm.yaml"), f"output_dir={root / 'rm'}", "train.steps=20", "train.batch_size=8",
                        "train.log_every=10", "model.pooling=attention", "train.loss=hps"])
    assert rc == 0
    return root


def test_train_rm_writes_a_loadable_rm_and_its_log(trained_srm):
    records = [json.loads(line) for line in (trained_srm / "rm" / "train.jsonl").read_text().splitlines()]
    assert [r.get("step") for r in records[:2]] == [10, 20]
    summary = records[-1]
    assert (summary["n_train"], summary["n_eval"]) == (36, 4)  # eval_fraction 0.1 held out of 40
    from streamrft.rm.model import ScalarRewardModel

    assert ScalarRewardModel.from_pretrained(trained_srm / "rm").pooling == "attention"


def test_eval_rm_reports_the_pairwise_accuracy_of_the_saved_rm(trained_srm, capsys):
    from streamrft.rm.model import ScalarRewardModel

    rows = [json.loads(line) for line in (trained_srm / "pairs.jsonl").read_text().splitlines()]
    rc = eval_rm_main(["--model", str(trained_srm / "rm"), "--data", str(trained_srm / "pairs.jsonl")])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rm = ScalarRewardModel.from_pretrained(trained_srm / "rm")
    strict = [r for r in rows if not r.get("tie")]
    rc_ = rm.score([r["prompt"] for r in strict], [r["chosen"] for r in strict])
    rr_ = rm.score([r["prompt"] for r in strict], [r["rejected"] for r in strict])
    assert result["n_pairs"] == 39
    assert result["pairwise_accuracy"] == pytest.approx(sum(c > r for c, r in zip(rc_, rr_)) / 39)


def test_eval_rm_needs_either_a_config_or_model_and_data(capsys):
    assert eval_rm_main(["--model", "x"]) == 2
    assert "give either CONFIG or both --model DIR and --data FILE" in capsys.readouterr().err


def test_train_rm_names_a_bad_row(tmp_path, capsys):
    write(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "chosen": "2"}])
    base = tmp_path / "base"
    build_tiny_qwen2(str(base), build_char_tokenizer(str(base), ARITH_ALPHABET), hidden_size=16, num_layers=1,
                     num_heads=2, num_kv_heads=1, intermediate_size=32)
    rc = train_rm_main(["", f"model.path={base}", f"data.train_path={tmp_path / 'bad.jsonl'}"])
    assert rc == 2
    assert f"{tmp_path / 'bad.jsonl'}: row 0: missing field 'rejected'" in capsys.readouterr().err


def test_serve_reward_serves_a_trained_rm_over_http(trained_srm):
    from streamrft.rm.model import ScalarRewardModel

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "streamrft.rewards.service", "--fn", f"model:{trained_srm / 'rm'}",
                             "--bind", "tcp://127.0.0.1:0", "--http", f"127.0.0.1:{port}"],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        for line in proc.stdout:
            if "serve-reward: ready" in line or time.monotonic() > deadline:
                break
        body = json.dumps({"queries": ["3+1=4", "3+1=5"], "prompts": ["3+1=", "3+1="]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            rewards = json.loads(resp.read())["rewards"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()
    expected = ScalarRewardModel.from_pretrained(trained_srm / "rm").score(["3+1=", "3+1="], ["4", "5"])
    assert rewards == pytest.approx(expected, abs=1e-5)
