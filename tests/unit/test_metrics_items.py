"""Issue 16 item 15: metrics a user reads. 1-based steps in every sink, held-out accuracy in every sink under
one name, the final step scraped before the exporter stops, MFU from a known GPU's peak and absent (not
NaN) without one. The last test is a real `streamrft train` observed from outside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from streamrft.metrics import PipelineMetrics, start_exporter, stop_exporter
from streamrft.metrics.heldout import heldout_scalars, merge_into_step_line
from streamrft.metrics.probe import PEAK_BF16_FLOPS, detect_peak_flops, peak_flops_for_device

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("name", "flops"), [
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12), ("NVIDIA A800-SXM4-80GB", 312e12),
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA H800", 989e12), ("NVIDIA H800 PCIe", 756e12), ("NVIDIA H20", 148e12),
    ("NVIDIA L40S", 362e12), ("NVIDIA L40", 181e12), ("NVIDIA L4", 121e12),
    ("NVIDIA B200", 2.25e15), ("NVIDIA B100", 1.75e15), ("NVIDIA GB200", 2.5e15),
    # no bf16 tensor cores, or not in the table: unknown, so no MFU
    ("Tesla V100-SXM2-32GB", 0.0), ("NVIDIA GeForce RTX 4090", 0.0), ("NVIDIA H2000", 0.0), ("", 0.0),
])
def test_item15_peak_bf16_flops_of_known_gpus_by_device_name(name, flops):
    assert peak_flops_for_device(name) == flops


def test_item15_every_table_row_is_reachable_and_a_cpu_has_no_peak():
    import torch

    assert detect_peak_flops(torch.device("cpu")) == 0.0
    samples = ["NVIDIA GB200", "NVIDIA B200", "NVIDIA B100", "NVIDIA GH200", "NVIDIA H100 PCIe", "NVIDIA H100 NVL",
               "NVIDIA H100", "NVIDIA H20", "NVIDIA A100", "NVIDIA L40S", "NVIDIA L40", "NVIDIA L4"]
    hit = [next(i for i, (p, _) in enumerate(PEAK_BF16_FLOPS) if __import__("re").search(p, n, 2)) for n in samples]
    assert sorted(set(hit)) == list(range(len(PEAK_BF16_FLOPS)))  # no row is shadowed by an earlier one


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {f"{s.name}{{{','.join(f'{k}={v}' for k, v in sorted(s.labels.items()) if k != 'rank')}}}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_item15_shutdown_waits_for_one_scrape_after_the_last_value_and_only_if_someone_scrapes():
    metrics = PipelineMetrics(rank=0)
    server, port = start_exporter(metrics, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        metrics.observe_step(1, {"loss": 1.0})
        assert metrics.wait_for_scrape_after_last_update(5.0) is False  # never scraped: no Prometheus, no wait
        assert metrics.exposition() and metrics.scrapes == 0  # a debugging exposition is not a scrape
        scrape(url)
        assert metrics.wait_for_scrape_after_last_update(0.0) is True  # step 1 was scraped
        metrics.observe_step(2, {"loss": 0.5})
        metrics.observe_heldout(2, {"heldout/accuracy": 0.75})
        started = time.monotonic()
        assert metrics.wait_for_scrape_after_last_update(0.3) is False  # nobody scraped step 2: the timeout
        assert 0.25 < time.monotonic() - started < 2.0
        seen: list[dict[str, float]] = []
        threading.Timer(0.4, lambda: seen.append(scrape(url))).start()
        started = time.monotonic()
        assert metrics.wait_for_scrape_after_last_update(10.0) is True
        assert 0.3 < time.monotonic() - started < 5.0  # woke by that scrape, not by the timeout
        time.sleep(0.1)
        assert seen[0]["streamrft_step{}"] == 2 and seen[0]["streamrft_heldout_accuracy{}"] == 0.75
        assert seen[0]["streamrft_heldout_step{}"] == 2
    finally:
        stop_exporter(server)


def test_item15_heldout_results_merge_into_their_step_line_under_one_name(tmp_path):
    assert heldout_scalars({"heldout_accuracy": 0.5, "heldout_n": 64.0, "heldout_reward_mean": 0.25, "x": 1.0,
                            "heldout_note": "text"}) == {
        "heldout/accuracy": 0.5, "heldout/n": 64.0, "heldout/reward_mean": 0.25}
    log = tmp_path / "steps.jsonl"
    log.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n')
    assert merge_into_step_line(log, 2, {"heldout/accuracy": 0.75})
    assert not merge_into_step_line(log, 3, {"heldout/accuracy": 0.1})  # not the last line's step
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        {"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25, "heldout/accuracy": 0.75}]
    assert not merge_into_step_line(tmp_path / "none.jsonl", 1, {})


@pytest.fixture(scope="module")
def tiny_text_model(tmp_path_factory) -> Path:
    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2

    root = tmp_path_factory.mktemp("tiny")
    build_tiny_qwen2(str(root / "model"), build_char_tokenizer(str(root / "model"), "0123456789+-*= "))
    (root / "data.jsonl").write_text("".join(f'{{"prompt": "{a}+{a}=", "reference": "{2 * a}"}}\n' for a in range(8)))
    return root


@pytest.mark.slow
def test_item15_a_real_run_uses_1_based_steps_and_heldout_accuracy_everywhere_and_its_final_step_is_scraped(
        tiny_text_model, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.ports import free_port

    port, out = free_port(), tmp_path / "run"
    cmd = [sys.executable, "-m", "streamrft.cli", "train", str(REPO / "pipelines" / "arith" / "config.yaml"),
           f"model.path={tiny_text_model / 'model'}", f"data.train_path={tiny_text_model / 'data.jsonl'}",
           f"data.eval_path={tiny_text_model / 'data.jsonl'}", "data.eval_size=8", f"output_dir={out}",
           "train.max_steps=3", "train.eval_every=2", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
           "metrics.progress=false", f"metrics.port={port}", "metrics.tensorboard=true",
           "metrics.final_scrape_timeout_s=20"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    scrapes: list[dict[str, float]] = []

    def scraper() -> None:
        """Find the exporter as soon as it listens, then scrape slowly: without the final wait, the run
        (under a second of steps) ends between two scrapes and its last values are never seen."""
        while proc.poll() is None:
            try:
                scrapes.append(scrape(f"http://127.0.0.1:{port}/metrics"))
            except OSError:
                time.sleep(0.02)
                continue
            time.sleep(1.5)

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    stdout, _ = proc.communicate(timeout=240)
    thread.join(10)
    assert proc.returncode == 0, stdout[-3000:]
    summary = json.loads(next(line for line in stdout.splitlines() if line.startswith("summary: "))[9:])

    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[0]["heldout/accuracy_before"] == summary["heldout_accuracy_before"]
    assert "heldout/accuracy" not in steps[0]
    assert steps[1]["heldout/n"] == 8.0 and 0.0 <= steps[1]["heldout/accuracy"] <= 1.0  # eval_every=2
    assert steps[2]["heldout/accuracy"] == summary["heldout_accuracy_after"]
    assert steps[2]["heldout/reward_mean"] == summary["heldout_reward_mean_after"]
    assert not any("mfu" in s for s in steps)  # CPU: no peak FLOP/s, no MFU (not NaN)
    assert [s["compile_seconds"] for s in steps] == [0.0, 0.0, 0.0]  # CPU defaults compile nothing

    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    assert {e.step: e.value for e in events.Scalars("loss")} == pytest.approx({s["step"]: s["loss"] for s in steps})
    held = {e.step: e.value for e in events.Scalars("heldout/accuracy")}
    assert held == pytest.approx({0: summary["heldout_accuracy_before"], 2: steps[1]["heldout/accuracy"],
                                  3: summary["heldout_accuracy_after"]})

    assert scrapes, stdout[-2000:]
    last = scrapes[-1]  # the exporter stayed up until a scrape after the final step and evaluation
    assert last["streamrft_step{}"] == 3
    assert last["streamrft_heldout_step{}"] == 3
    assert last["streamrft_heldout_accuracy{}"] == summary["heldout_accuracy_after"]
    assert last["streamrft_loss{}"] == pytest.approx(steps[2]["loss"])
    assert not any(key.startswith("streamrft_mfu") for s in scrapes for key in s)
    assert "waiting up to 20 s for Prometheus to scrape the final values" in stdout
