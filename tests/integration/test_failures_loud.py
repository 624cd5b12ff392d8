"""Issue 16 items 1 and 2 on real runs: `streamrft train` with a reward function that raises, or a sync
one that never returns, ends with the failure policy's error (source, counts, step, first failure),
a non-zero exit code, and the process gone within a bounded time (no hung thread is joined)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time

import pytest

from tests.integration.conftest import REPO, arith_overrides
from tests.integration.test_train_e2e import CONFIG, env_one_thread
from tests.ports import free_port

pytestmark = pytest.mark.slow

FUNCS = textwrap.dedent(
    """
    import os, threading

    _calls = []
    _lock = threading.Lock()

    def fails_on_rank_1(response, reference):  # rank 1's first 12 calls fail (it keeps 4 samples to train)
        with _lock:
            _calls.append(1)
            n = len(_calls)
        if os.environ.get("RANK") == "1" and n <= 12:
            raise ValueError("rank 1 cannot score")
        return 1.0

    def hangs(response, reference):  # a sync reward that never returns (a deadlock, a lost socket...)
        threading.Event().wait()

    def boom(response, reference):
        raise ValueError("boom")

    def aborts_like_a_native_library(response, reference):  # a C extension's abort() inside the run
        os.abort()
    """
)


@pytest.mark.parametrize(
    "fn, first_failure",
    [
        ("boom", "first failure: ValueError('boom') in sample s0-p"),
        ("hangs", "first failure: timeout after 1s (reward.timeout_s) in sample s0-p"),
    ],
)
def test_item1_item2_a_failing_reward_stops_the_run_loudly_with_a_non_zero_exit(arith_dir, tmp_path, fn, first_failure):
    (tmp_path / "fns.py").write_text(FUNCS)
    source = f'reward.sources=[{{name: my_fn, type: custom, fn: "{tmp_path / "fns.py"}:{fn}"}}]'
    overrides = arith_overrides(arith_dir, tmp_path / "out", "train.max_steps=5", "reward.timeout_s=1", source)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "streamrft.cli", "train", str(CONFIG), *overrides],
                          env=env_one_thread(), cwd=REPO, capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-4000:]
    # 8 prompts x 4 samples, every one failed by the one source, at the first step: stop there.
    assert ("streamrft: error: rank 0: reward source 'my_fn' failed 32 of 32 samples at step 1 "
            "(limit 0.5, reward.max_failed_fraction): " + first_failure) in proc.stderr, out[-4000:]
    assert "streamrft: step 1: failed 32 (reward: 32) — first: reward: source 'my_fn': " in proc.stdout, out[-4000:]
    assert "step 2" not in proc.stdout and "summary:" not in proc.stdout
    # Bounded: a hung call costs its timeout (held-out eval, then step 1), and exit does not join its threads.
    assert elapsed < 120, f"the run took {elapsed:.0f}s"


def test_item1_two_ranks_stop_together_when_only_one_rank_fails_its_samples(arith_dir, tmp_path):
    """Rank 1 fails 12 of its 16 samples, rank 0 none: 12 of 32 (0.375) over both ranks. With the limit
    0.3 both ranks stop at step 1 (rank 0 on counts it did not see itself) instead of one stopping and
    the other waiting in the next collective."""
    (tmp_path / "fns.py").write_text(FUNCS)
    source = f'reward.sources=[{{name: my_fn, type: custom, fn: "{tmp_path / "fns.py"}:fails_on_rank_1"}}]'
    overrides = arith_overrides(arith_dir, tmp_path / "out", "train.max_steps=3", "data.eval_path=",
                                "reward.max_failed_fraction=0.3", source)
    env = dict(env_one_thread(), NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    started = time.monotonic()
    proc = subprocess.run([str(REPO / "launch" / "colocate.sh"), str(CONFIG), *overrides],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    stop = "reward source 'my_fn' failed 12 of 32 samples at step 1 (limit 0.3, reward.max_failed_fraction): first failure: "
    assert f"rank 0: {stop}(on another rank)" in out, out[-4000:]
    assert f"rank 1: {stop}ValueError('rank 1 cannot score') in sample s0-p" in out, out[-4000:]
    assert "step 1: failed 12 (reward: 12)" in out and "step 2" not in out
    assert time.monotonic() - started < 180


def test_a_rank_killed_by_a_fatal_signal_prints_where_each_thread_was(arith_dir, tmp_path):
    """A native library's abort (or segfault) ends a rank without a Python exception: `streamrft train` has Python's
    faulthandler print every thread's stack first, so the log says where the run was, not only "exitcode -6"."""
    (tmp_path / "fns.py").write_text(FUNCS)
    source = f'reward.sources=[{{name: my_fn, type: custom, fn: "{tmp_path / "fns.py"}:aborts_like_a_native_library"}}]'
    overrides = arith_overrides(arith_dir, tmp_path / "out", "data.eval_path=", source)
    proc = subprocess.run([sys.executable, "-m", "streamrft.cli", "train", str(CONFIG), *overrides],
                          env=env_one_thread(), cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == -6, (proc.stdout + proc.stderr)[-4000:]  # SIGABRT
    assert "Fatal Python error: Aborted" in proc.stderr, proc.stderr[-4000:]
    # the thread that called it, named by file, line and function
    assert re.search(r'fns\.py", line \d+ in aborts_like_a_native_library', proc.stderr), proc.stderr[-4000:]
