"""A real Prometheus server scrapes a real exporter process; the values come back through its API."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.ports import free_port

pytestmark = pytest.mark.slow

PROMETHEUS = shutil.which("prometheus")
REPO = Path(__file__).resolve().parents[2]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.25)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.fixture
def simulator(tmp_path):
    port_file = tmp_path / "port"
    process = subprocess.Popen(
        [sys.executable, "-m", "streamrft.metrics.simulate", "--port-file", str(port_file), "--rank", "3",
         "--seconds", "60", "--interval", "0.25"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        wait_for(lambda: port_file.exists() or process.poll() is not None, 20, "the simulator's port file")
        assert process.poll() is None, process.stderr.read().decode()
        yield int(port_file.read_text())
    finally:
        stop(process)


@pytest.fixture
def prometheus(tmp_path, simulator):
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (apt-get install -y prometheus)")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: streamrft\n    static_configs: [{{targets: ['127.0.0.1:{simulator}']}}]\n"
    )
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(process)


def query(base: str, promql: str, at: float | None = None) -> list[dict]:
    params = {"query": promql} | ({"time": f"{at:.3f}"} if at is not None else {})
    url = f"{base}/api/v1/query?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            body = json.load(response)
    except OSError:
        return []
    return body["data"]["result"] if body.get("status") == "success" else []


def value(base: str, promql: str, at: float | None = None) -> float | None:
    result = query(base, promql, at)
    return float(result[0]["value"][1]) if result else None


def test_prometheus_scrapes_the_exporter_and_its_api_returns_the_exported_values(prometheus):
    wait_for(lambda: value(prometheus, 'streamrft_loss{rank="3"}') is not None, 25, "the first scrape")
    at = time.time()  # every query below reads the same scrape, so the counters agree with each other
    assert value(prometheus, 'streamrft_stage_queue_depth{rank="3",stage="reward"}', at) == 7
    assert value(prometheus, 'streamrft_reward_mean{rank="3",component="correct"}', at) == 0.75
    assert value(prometheus, 'streamrft_learning_rate{rank="3"}', at) == 1e-3
    # The simulator's accounting: each step admits 8 = 6 trained + 1 filtered + 1 failed.
    admitted = value(prometheus, 'streamrft_samples_admitted_total{rank="3"}', at)
    assert admitted and admitted % 8 == 0
    step = admitted / 8
    assert value(prometheus, 'streamrft_samples_trained_total{rank="3"}', at) == 6 * step
    assert value(prometheus, 'streamrft_samples_filtered_total{rank="3",reason="zero_std"}', at) == step
    assert value(prometheus, 'streamrft_samples_failed_total{rank="3",reason="reward_timeout"}', at) == step
    assert value(prometheus, 'streamrft_step{rank="3"}', at) == step
    assert value(prometheus, 'streamrft_loss{rank="3"}', at) == pytest.approx(1 / step)
    # Counters keep rising between scrapes, so rate() (the dashboard's tokens/s) is positive.
    wait_for(lambda: (value(prometheus, "sum(rate(streamrft_generated_tokens_total[5s]))") or 0) > 0, 15,
             "a positive generated tokens/s rate")
    quantile = value(prometheus, "histogram_quantile(0.5, sum by (le) (streamrft_phase_switch_seconds_bucket))")
    assert quantile is not None and 0.25 < quantile <= 0.5
