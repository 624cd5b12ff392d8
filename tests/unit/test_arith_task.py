import json
import random

import pytest
import torch

from pipelines.arith.task import (ARITH_ALPHABET, all_problems, greedy_accuracy, is_correct, make_problem,
                                  make_rows, split_of, write_dataset)
from streamrft.data import read_rows
from streamrft.learner.sft import answer_loss, build_sft_batch, supervised_warmup
from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2, load_policy

torch.set_num_threads(1)


def test_make_problem_answers_are_the_arithmetic_result():
    rng = random.Random(0)
    for _ in range(200):
        prompt, answer = make_problem(rng, 0, 99, "+-")
        left, right = prompt.rstrip("=").replace("-", " - ").replace("+", " + ").split(" ", 1)
        op, b = right.split()
        assert int(answer) == (int(left) + int(b) if op == "+" else int(left) - int(b))
        assert set(prompt + answer) <= set(ARITH_ALPHABET)


def test_train_and_eval_splits_are_disjoint_and_cover_every_problem():
    train = all_problems("train", 0, 30, "+")
    held_out = all_problems("eval", 0, 30, "+")
    assert not {p for p, _ in train} & {p for p, _ in held_out}
    assert len(train) + len(held_out) == 31 * 31
    assert 0.05 < len(held_out) / (31 * 31) < 0.15
    assert all(split_of(p, 0.1) == "eval" for p, _ in held_out)


def test_write_dataset_is_deterministic_given_the_seed_and_rows_are_distinct(tmp_path):
    a = write_dataset(str(tmp_path / "a.jsonl"), 300, seed=5)
    b = write_dataset(str(tmp_path / "b.jsonl"), 300, seed=5)
    assert open(a).read() == open(b).read()
    rows = read_rows(a)
    assert len(rows) == 300 and len({r["prompt"] for r in rows}) == 300
    assert rows[0].keys() == {"prompt", "reference", "label"} and rows[0]["label"] == "arith"
    assert read_rows(write_dataset(str(tmp_path / "c.jsonl"), 300, seed=6)) != rows
    assert json.loads(open(a).readline()) == rows[0]


def test_asking_for_more_rows_than_problems_names_the_fix():
    with pytest.raises(ValueError, match="n=50 exceeds"):
        make_rows(50, 0, "eval", 0, 9)


def test_is_correct_is_exact_match_after_whitespace_strip():
    assert is_correct("68", "68") and is_correct(" 68 ", "68")
    assert not is_correct("068", "68") and not is_correct("6", "68")


def test_sft_batch_puts_labels_on_answer_and_eos_only(tmp_path):
    tok = build_char_tokenizer(str(tmp_path), ARITH_ALPHABET)
    ids_BL, mask_BL, labels_BL = build_sft_batch(tok, [{"prompt": "1+2=", "reference": "3"},
                                                       {"prompt": "10+20=", "reference": "30"}])
    assert ids_BL.shape == (2, 9)
    assert tok.decode(ids_BL[1].tolist()) == "10+20=30<eos>"
    assert labels_BL[0].tolist() == [-100] * 4 + [tok("3")["input_ids"][0], 1] + [-100] * 3
    assert mask_BL[0].tolist() == [1] * 6 + [0] * 3
    # answer_loss = mean CE over labelled next tokens, checked against a direct sum
    logits_BLV = torch.randn(2, 9, len(tok), generator=torch.Generator().manual_seed(0))
    terms = [-torch.log_softmax(logits_BLV[b, t - 1], -1)[labels_BL[b, t]]
             for b in range(2) for t in range(1, 9) if labels_BL[b, t] != -100]
    assert len(terms) == 5
    assert answer_loss(logits_BLV, labels_BL).item() == pytest.approx(torch.stack(terms).mean().item(), abs=1e-5)


def test_a_short_warmup_lowers_the_answer_loss_and_greedy_accuracy_counts_exact_matches(tmp_path):
    out = str(tmp_path)
    tok = build_char_tokenizer(out, ARITH_ALPHABET)
    build_tiny_qwen2(out, tok, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64)
    model, tok = load_policy(out)
    rows = [{"prompt": f"{a}+{a}=", "reference": str(2 * a), "label": "arith"} for a in range(5)]
    model.eval()
    losses = supervised_warmup(model, tok, rows, steps=60, lr=1e-2, batch_size=8, seed=0)
    assert len(losses) == 60 and sum(losses[-5:]) / 5 < 0.3 * sum(losses[:5]) / 5
    assert not model.training  # mode restored
    acc = greedy_accuracy(model, tok, rows, max_new_tokens=4)
    wrong = [dict(r, reference=r["reference"] + "9") for r in rows]
    assert acc == 1.0 and greedy_accuracy(model, tok, wrong, max_new_tokens=4) == 0.0


def test_prepare_writes_model_and_data_once_and_skips_existing_outputs(tmp_path):
    from pipelines.arith.prepare import prepare

    paths = prepare(str(tmp_path), seed=0, warmup_steps=3, n_train=40, n_eval=10)
    assert len(read_rows(paths["train_path"])) == 40 and len(read_rows(paths["eval_path"])) == 10
    report = json.load(open(f"{paths['model_dir']}/warmup.json"))
    assert report["steps"] == 3 and len(report["losses"]) == 3 and 0.0 <= report["eval_greedy_accuracy"] <= 1.0
    model, tok = load_policy(paths["model_dir"])
    assert tok("12+3=")["input_ids"] == [ARITH_ALPHABET.index(c) + 3 for c in "12+3="]
    stamp = {p: (tmp_path / p).stat().st_mtime_ns for p in ("train.jsonl", "sft/model.safetensors")}
    assert prepare(str(tmp_path), seed=0, warmup_steps=3, n_train=40, n_eval=10) == paths
    assert {p: (tmp_path / p).stat().st_mtime_ns for p in stamp} == stamp
