"""benchmarks/gpu_flops.py and gpu_grpo.py's report on the long-tailed workload: the rollout floor and FLOPs count
each row's own length (a row stops being decoded after its last token), so the table's roofl% is against the
engine-only call's real lengths and never the "every row to the cap" floor; the async placement, whose engine is
not timed alone, shows "-" instead of NaN (benchmarks/NOTES.md v25 printed 191.3 % and nan)."""

import math
import statistics
import sys
from pathlib import Path

import pytest
from transformers import Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpu_flops import rollout_floor_s, rollout_flops, rows_decoding, shape_of  # noqa: E402
from gpu_grpo import engine_only_lengths, report, steady_steps, step_lengths, workload  # noqa: E402

SHAPE = dict(H=8, L=2, n_h=2, n_kv=1, d=4, V=16, body=1000)


def test_rows_decoding_counts_the_rows_still_producing_tokens():
    assert rows_decoding(3, 4) == [3, 3, 3, 3]
    # rows of 1, 3, 2 and 3 new tokens: all make the prefill's token, three the second, two the third
    assert rows_decoding(4, 99, [1, 3, 2, 3]) == [4, 3, 2]
    with pytest.raises(ValueError, match="3 rows of at least one new token each, got 2 rows"):
        rows_decoding(3, 4, [2, 2])
    with pytest.raises(ValueError, match="shortest 0"):
        rows_decoding(2, 4, [0, 2])


def test_equal_lengths_give_the_fixed_floor_and_flops():
    assert rollout_floor_s(SHAPE, 5, 7, 9, 1e9, 1e12) == rollout_floor_s(SHAPE, 5, 7, 9, 1e9, 1e12, [9] * 5)
    assert rollout_flops(SHAPE, 5, 7, 9) == rollout_flops(SHAPE, 5, 7, 9, [9] * 5)


def test_ragged_rollout_flops_are_the_sum_of_each_rows_own():
    lengths, Lp = [1, 4, 2, 7], 3
    attn = 4 * SHAPE["n_h"] * SHAPE["d"] * SHAPE["L"]
    per_token = 2 * SHAPE["body"] + 2 * SHAPE["V"] * SHAPE["H"]

    def row(n):  # the prompt's prefill, then n tokens at contexts Lp .. Lp + n - 1 (closed form of the sum)
        return Lp * (2 * SHAPE["body"] + attn * Lp / 2) + n * per_token + attn * (n * Lp + n * (n - 1) / 2)

    assert rollout_flops(SHAPE, 4, Lp, 7, lengths) == pytest.approx(sum(row(n) for n in lengths), rel=1e-12)


def test_ragged_decode_floor_by_hand():
    # rows of 1 and 3 new tokens, prompt 2: decode steps 1 and 2 run the long row alone (context 3, then 4).
    # Bandwidth so high that every step is FLOP-bound: the floor is the FLOPs of those two steps over the rate.
    attn = 4 * SHAPE["n_h"] * SHAPE["d"] * SHAPE["L"]
    per_token = 2 * SHAPE["body"] + 2 * SHAPE["V"] * SHAPE["H"]
    prefill, decode = rollout_floor_s(SHAPE, 2, 2, 3, 1e30, 1e6, [1, 3])
    assert decode == pytest.approx(((per_token + attn * 3) + (per_token + attn * 4)) / 1e6, rel=1e-12)
    assert prefill == rollout_floor_s(SHAPE, 2, 2, 3, 1e30, 1e6)[0]  # the prefill does not depend on the lengths
    # memory-bound: every step reads the weights, and the KV cache of the rows still decoding only
    weights = 2 * (SHAPE["body"] + SHAPE["V"] * SHAPE["H"])
    kv = lambda b, c: SHAPE["L"] * 2 * b * SHAPE["n_kv"] * c * SHAPE["d"] * 2  # noqa: E731
    _, decode = rollout_floor_s(SHAPE, 2, 2, 3, 1e3, 1e30, [1, 3])
    assert decode == pytest.approx((weights + kv(1, 3) + weights + kv(1, 4)) / 1e3, rel=1e-12)


def _result(system, engine_s, steps=3):
    return {"system": system, "steps": steps, "step_s": 2.0, "rollout_s": 1.0, "train_s": 1.0, "rollout_tok_s": 1e3,
            "trained_tok_s": 1e3, "peak_gib": 1.0, "peak_reserved_gib": 1.0, "phase_switch_s": 0.0,
            "weight_sync_s": 0.0, "engine_only_s": engine_s, "train_flops": 1e9}


def test_the_long_tailed_table_uses_real_lengths_and_shows_no_nan(tmp_path):
    wl = workload(True, "longtail", "tiny")
    B = wl["prompts"] * wl["samples"]
    assert engine_only_lengths(wl) == [wl["shape"].length(i) for i in range(B)]
    assert engine_only_lengths(workload(True, "fixed", "tiny")) is None
    assert steady_steps(3) == [1] and steady_steps(5) == [1, 2, 3] and steady_steps(2) == [1]
    assert steady_steps(1) == [0]
    cfg = Qwen2Config(vocab_size=wl["vocab"], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    cfg.save_pretrained(tmp_path / "model_tiny")
    s = shape_of(cfg)
    pf, dec = rollout_floor_s(s, B, wl["prompt_len"], wl["new"], 4e12, 8e14, engine_only_lengths(wl))
    pf_cap, dec_cap = rollout_floor_s(s, B, wl["prompt_len"], wl["new"], 4e12, 8e14)
    assert pf + dec < pf_cap + dec_cap  # the tiny lengths (median 4, cap 16) are mostly below the cap
    engine_s = 2 * (pf + dec)  # the engine-only call at half its real floor's speed: 50.0 %
    # TRL's engine-only time is the median of its steady generate calls (steps 1 and 2): their own lengths' floor
    trl_floor = statistics.median(sum(rollout_floor_s(s, B, wl["prompt_len"], wl["new"], 4e12, 8e14,
                                                      step_lengths(wl, k))) for k in (1, 2))
    trl = {**_result("trl", 4 * trl_floor), "steady_steps": [1, 2], "engine_only_steps": [1, 2]}
    results = {"_out": str(tmp_path), "tiny_streamrft": _result("streamrft", engine_s),
               "tiny_async": _result("async", float("nan")), "tiny_trl": trl}
    table = report(results, {"copy_bytes_per_s": 4e12, "bf16_flops_per_s": 8e14}, {"tiny": wl}, ["tiny"])
    colocated = next(line for line in table.splitlines() if line.startswith("tiny  streamrft"))
    asynchronous = next(line for line in table.splitlines() if line.startswith("tiny  async"))
    assert colocated.split()[12] == "50.0"  # roofl%: the floor of the engine-only call's own lengths
    assert asynchronous.split()[11:13] == ["-", "-"] and "nan" not in asynchronous
    assert next(line for line in table.splitlines() if line.startswith("tiny  trl")).split()[12] == "25.0"
    # stepMFU%: the trained FLOPs plus the rollout FLOPs of the steady step's own lengths (step 1 of 3)
    rf = rollout_flops(s, B, wl["prompt_len"], wl["new"], step_lengths(wl, 1))
    assert float(colocated.split()[14]) == pytest.approx(100 * (1e9 + rf) / (2.0 * 8e14), abs=0.06)
    assert not math.isclose(rf, rollout_flops(s, B, wl["prompt_len"], wl["new"]))
