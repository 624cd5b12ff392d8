"""Trajectory analysis and HTML rendering on records written by the real sinks."""

from __future__ import annotations

import json

import pytest

from protocols import TrajectoryRecord
from streamrft.sinks import JsonlSink, ParquetSink
from streamrft.sinks.analyze import analyze_main, analyze_trajectories
from streamrft.sinks.render import render_main, render_trajectories, token_strings


def record(i: int, response: str, ids: list[int], entropy: list[float], reward: float) -> TrajectoryRecord:
    return TrajectoryRecord(
        run_id="r", rank=0, step=i // 2, sample_id=f"s{i}", group_id="g", policy_version=0, prompt="p",
        response=response, prompt_ids=[1], response_ids=ids, behaviour_logprobs=[-0.5] * len(ids),
        entropy=entropy, reward=reward, reward_components={"correct": reward}, advantage=reward - 0.5,
        finish_reason="stop",
    )


KNOWN = [
    # repeated 4-gram (1 2 3 4 twice), says "Wait" and "however"
    record(0, "Wait, however it loops", [1, 2, 3, 4, 1, 2, 3, 4], [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], 1.0),
    # no repetition, "let me verify"
    record(1, "let me verify: 42", [5, 6, 7, 8], [3.0, 3.0, 3.0, 3.0], 0.0),
    record(2, "42", [9, 10], [0.5, 0.5], 1.0),
    record(3, "waiter is not wait-listed", [11, 12, 13], [], 0.0),
]


@pytest.fixture(params=["jsonl", "parquet"])
def written(request, tmp_path):
    sink = JsonlSink(tmp_path, "r", 0) if request.param == "jsonl" else ParquetSink(tmp_path, 3, "r", 0)
    for r in KNOWN:
        sink.write(r)
    sink.close()
    return tmp_path


def test_analysis_reports_repetition_reflection_entropy_and_reward_of_known_records(written):
    report = analyze_trajectories(written, ngram=4, high_entropy=2.0)
    assert report["samples"] == 4 and report["steps"] == 2
    assert report["repetition"]["repeated_ngram_fraction"] == 0.25
    # distinct-1 per response: 4/8, 4/4, 2/2, 3/3
    assert report["repetition"]["distinct_1_mean"] == pytest.approx((0.5 + 1 + 1 + 1) / 4)
    counts = report["reflection"]["counts"]
    assert counts["wait"] == 2 and counts["however"] == 1 and counts["let me verify"] == 1  # not "waiter"
    assert report["reflection"]["responses_with_any_fraction"] == 0.75
    entropy = report["entropy"]
    assert entropy["tokens"] == 14
    assert entropy["mean"] == pytest.approx((4 * 1.0 + 4 * 3.0 + 2 * 0.5) / 14)
    assert entropy["p50"] == pytest.approx(1.0)  # sorted: 0 x4, 0.5 x2, 1 x4, 3 x4
    assert entropy["p99"] == pytest.approx(3.0)
    assert entropy["high_entropy_fraction"] == pytest.approx(4 / 14)
    assert report["reward"]["mean"] == 0.5 and report["reward_components"] == {"correct": 0.5}


def test_analyze_command_prints_a_readable_report_and_json_on_request(written, capsys):
    assert analyze_main([str(written)]) == 0
    text = capsys.readouterr().out
    assert "repeated 4-gram: 25.0%" in text and "p90" in text and "'wait': 2" in text
    assert analyze_main([str(written), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 4


def test_analyze_command_names_a_missing_path_and_exits_2(tmp_path, capsys):
    assert analyze_main([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_render_writes_a_self_contained_page_with_high_entropy_tokens_outlined(written, tmp_path):
    out = tmp_path / "page.html"
    assert render_main([str(written), "--out", str(out), "--max-samples", "3"]) == 0
    page = out.read_text()
    assert page.count('class="sample"') == 3
    assert "http://" not in page and "https://" not in page and "<script" not in page and "<link" not in page
    # Record 1's four tokens have entropy 3.0 > 2.0: outlined; record 0's are not.
    assert page.count('class="tok hi"') == 4 + 1  # plus the legend's 2x-threshold swatch
    assert "H=3.000" in page and "reward <b>1</b>" in page


def test_token_strings_fall_back_from_callable_to_characters_to_ids():
    chars = record(0, "abc", [1, 2, 3], [], 0.0)
    assert token_strings(chars) == (["a", "b", "c"], True)
    assert token_strings(chars, lambda ids: [f"<{i}>" for i in ids]) == (["<1>", "<2>", "<3>"], True)
    words = record(0, "hello world", [7, 8], [], 0.0)
    assert token_strings(words) == (["#7", "#8"], False)


def test_render_trajectories_returns_how_many_samples_it_shows(written, tmp_path):
    assert render_trajectories(written, tmp_path / "a.html", max_samples=10) == 4
