"""A training run scored by a real reward-service process that is killed mid-run and restarted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from tests.integration.conftest import REPO, arith_overrides
from tests.ports import free_port

pytestmark = pytest.mark.slow
CONFIG = REPO / "pipelines" / "arith" / "config.yaml"


def start_service(port: int, log_path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    log = open(log_path, "a")
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrft.rewards.service", "--fn", "arith", "--bind", f"tcp://127.0.0.1:{port}", "--log-requests"],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
    )
    deadline = time.monotonic() + 60
    while "serve-reward: ready" not in open(log_path).read().split("serve-reward: stopped")[-1]:
        assert proc.poll() is None, open(log_path).read()[-2000:]
        assert time.monotonic() < deadline, "reward service did not start"
        time.sleep(0.1)
    return proc


def test_a_killed_and_restarted_reward_service_loses_no_sample(arith_dir, tmp_path):
    port = free_port()
    service_log = tmp_path / "service.log"
    service = start_service(port, service_log)
    overrides = arith_overrides(
        arith_dir, tmp_path / "run", "train.max_steps=6", "data.eval_path=",
        f"reward.sources=[{{name: exact, type: remote, address: 'tcp://127.0.0.1:{port}'}}]",
        "reward.timeout_s=2", "reward.retries=10",
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    train = subprocess.Popen([sys.executable, "-m", "streamrft.cli", "train", str(CONFIG), *overrides],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    out = []
    try:
        for line in train.stdout:
            out.append(line)
            if line.startswith("step 2/"):
                service.send_signal(signal.SIGKILL)
                service.wait(10)
                time.sleep(1.0)
                service = start_service(port, service_log)
        train.wait(240)
    finally:
        for proc in (train, service):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    text = "".join(out)
    assert train.returncode == 0, text[-3000:]
    summary = json.loads(text.split("summary: ", 1)[1].splitlines()[0])
    assert summary["samples_admitted"] == summary["samples_trained"] == 6 * 32
    assert not any(k.startswith("samples_failed") for k in summary)
    # Within one service lifetime, no request id is scored twice (idempotent retries).
    for lifetime in service_log.read_text().split("serve-reward: ready")[1:]:
        scored = Counter(re.findall(r"scoring request (\S+)", lifetime))
        assert scored and max(scored.values()) == 1
