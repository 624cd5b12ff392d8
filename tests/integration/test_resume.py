"""Exact resume: a run killed with SIGKILL and resumed logs bitwise the same steps as an uninterrupted run
(FSDP2 on gloo, 1 rank via the CLI with synchronous saves and 2 ranks via launch/colocate.sh with
checkpoint.async_save=true); SIGTERM saves the last step."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamrft.checkpoint import complete_checkpoints, read_meta
from tests.integration.conftest import REPO, arith_eval_overrides, arith_overrides, rank_pid, sigterm_after_step
from tests.ports import free_port

pytestmark = pytest.mark.slow
CONFIG = REPO / "pipelines" / "arith" / "config.yaml"
MAX_STEPS = 4
# kl_coef > 0 (KL in the loss) makes every step's loss and gradient non-zero once the policy has moved.
SETTINGS = ("train.deterministic=true", "algorithm.kl_coef=0.05", "data.eval_path=", "rollout.prompts_per_step=4")
NOT_COMPARED = re.compile(r"seconds|per_s$")  # timings


def env_one_thread() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def command(arith_dir, out: Path, ranks: int, *extra: str) -> tuple[list[str], dict]:
    overrides = arith_overrides(arith_dir, out, *SETTINGS, f"train.max_steps={MAX_STEPS}", *extra)
    if ranks == 1:
        return [sys.executable, "-m", "streamrft.cli", "train", str(CONFIG), *overrides], env_one_thread()
    env = dict(env_one_thread(), NPROC_PER_NODE=str(ranks), MASTER_PORT=str(free_port()))
    # A copy of the config away from pipelines/arith: colocate.sh then skips prepare.py (the fixture
    # already prepared everything, and prepare.py reads the first override as its out_dir).
    config = out.parent / f"{out.name}.yaml"
    config.write_text(CONFIG.read_text())
    return [str(REPO / "launch" / "colocate.sh"), str(config), *overrides], env


def run(cmd_env) -> str:
    cmd, env = cmd_env
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def steps_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (torchrun starts its workers in their own sessions, so a process
    group kill would miss them), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def sigkill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the workers, then the launcher, and reap what we can (a crash of the whole job)."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)


def kill_after_first_checkpoint(cmd_env, out: Path) -> None:
    """Start the run; SIGKILL it and its workers once step 1 is logged and a checkpoint is complete (a
    synchronous save is complete before the log line, an asynchronous one may complete after it)."""
    cmd, env = cmd_env
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 180
        log = out / "steps.jsonl"
        while not (log.exists() and log.read_text().count("\n") >= 1 and complete_checkpoints(out)):
            assert proc.poll() is None, f"run ended (rc {proc.returncode}) before its first step"
            assert time.monotonic() < deadline, "no step within 180 s"
            time.sleep(0.02)
    finally:
        workers = descendants(proc.pid)
        sigkill_tree(proc)
    deadline = time.monotonic() + 30  # the killed workers must be gone before the resumed run starts
    while any(alive(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} of the killed run are still alive"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def assert_resume_is_exact(arith_dir, tmp_path, ranks: int, *saving: str) -> None:
    ref, res = tmp_path / "uninterrupted", tmp_path / "resumed"
    run(command(arith_dir, ref, ranks, *saving))
    kill_after_first_checkpoint(command(arith_dir, res, ranks, "checkpoint.save_every=1", *saving), res)
    start = complete_checkpoints(res)[-1][0]
    assert 1 <= start < MAX_STEPS, f"killed too late: checkpoint of step {start}"
    stdout = run(command(arith_dir, res, ranks, "checkpoint.save_every=1", *saving))
    assert f"resumed from {res / 'checkpoints' / f'step_{start:08d}'} at step {start}" in stdout
    expected, got = steps_of(ref), steps_of(res)
    assert [s["step"] for s in got] == list(range(1, MAX_STEPS + 1))
    for a, b in zip(expected, got):
        compared = {k: v for k, v in a.items() if not NOT_COMPARED.search(k)}
        assert compared == {k: b[k] for k in compared}, f"step {a['step']} differs"
    assert any(s["grad_norm"] > 0 for s in got[start:]), "the resumed steps never moved the weights"
    assert read_meta(complete_checkpoints(res)[-1][1])["step"] == MAX_STEPS
    assert read_meta(complete_checkpoints(ref)[-1][1])["async_save"] is ("checkpoint.async_save=true" in saving)


# one busy process at a time: `make test` runs it in the unit group (tests/conftest.py)
@pytest.mark.one_process
def test_a_killed_one_rank_run_resumes_bitwise_like_an_uninterrupted_one(arith_dir, tmp_path):
    assert_resume_is_exact(arith_dir, tmp_path, ranks=1)


def test_a_killed_two_rank_run_resumes_bitwise_like_an_uninterrupted_one(arith_dir, tmp_path):
    # async saves: the background writes' collectives on their own gloo group across two processes
    assert_resume_is_exact(arith_dir, tmp_path, 2, "checkpoint.async_save=true")


# one busy process at a time: `make test` runs it in the unit group (tests/conftest.py)
@pytest.mark.one_process
def test_sigterm_saves_the_last_completed_step_and_exits_cleanly(arith_dir, tmp_path):
    cmd, env = command(arith_dir, tmp_path, 1, "train.max_steps=1000")
    code, out = sigterm_after_step(cmd, env, step=2)
    assert code == 130, out[-3000:]
    assert "stopped by SIGTERM on rank 0; sockets closed" in out
    ((step, path),) = complete_checkpoints(tmp_path)  # save_every=0: only the signal's checkpoint
    meta = read_meta(path)
    assert step >= 2 and meta["reason"] == "signal" and meta["policy_version"] == step
    assert f"saved {path} on signal" in out


def test_a_signal_to_one_rank_stops_both_after_the_same_step_and_saves_it(arith_dir, tmp_path):
    """SIGTERM to rank 1 alone (a scheduler or a user that signals one process): the ranks agree at the next
    batch all-reduce, so both stop after the same step and their next collectives (the signal save's) match;
    before, rank 1 went to the save while rank 0 trained on, and both hung until torchrun killed them."""
    cmd, env = command(arith_dir, tmp_path, 2, "train.max_steps=1000")
    code, out = sigterm_after_step(cmd, env, step=2, wait_s=180, new_session=True,
                                   target=lambda: rank_pid(str(tmp_path), rank=1))
    assert code != 0, out[-3000:]
    assert "stopped by SIGTERM on rank 1; sockets closed" in out, out[-3000:]
    assert "stopped by another rank's signal on rank 0; sockets closed" in out, out[-3000:]
    ((step, path),) = complete_checkpoints(tmp_path)
    assert step >= 2 and read_meta(path)["reason"] == "signal"
    assert f"saved {path} on signal" in out


def test_a_signal_during_a_heldout_evaluation_stops_both_ranks_at_once_and_saves_the_step_before_it(arith_dir,
                                                                                                   tmp_path):
    """SIGTERM to rank 1 while both ranks evaluate after step 1 (train.eval_every=1): rank 1 leaves its
    evaluation at once, rank 0 ends its own at the agreement placed before the evaluation's all-reduces, and
    both stop there, saving step 1. Before, the evaluation ran to its end (printing its result) and the ranks
    stopped at the next step's agreement."""
    # 8192 rows (operands to 999: 0-99 give 989 distinct problems) take seconds to evaluate on CI's 2 cores; 512
    # took 0.1 s, less than the test's way from a step's line to the signal
    long_eval = arith_eval_overrides(tmp_path, 8192, max_operand=999)
    cmd, env = command(arith_dir, tmp_path / "out", 2, "train.max_steps=1000", "train.eval_every=1", *long_eval)
    code, out = sigterm_after_step(cmd, env, step=1, wait_s=180, new_session=True,
                                   target=lambda: rank_pid(str(tmp_path / "out"), rank=1))
    assert code != 0, out[-3000:]
    assert "stopped by SIGTERM on rank 1; sockets closed" in out, out[-3000:]
    assert "stopped by another rank's signal on rank 0; sockets closed" in out, out[-3000:]
    assert "step 1: {" not in out, out[-3000:]  # the evaluation after step 1 never printed its result
    ((step, path),) = complete_checkpoints(tmp_path / "out")
    assert step == 1 and read_meta(path)["reason"] == "signal"


@pytest.mark.one_process
def test_a_second_signal_stops_at_once_without_saving(arith_dir, tmp_path):
    """SIGINT and SIGTERM delivered together (both pending while the process is stopped with SIGSTOP, so
    its event loop takes them in one pass): the first asks for the agreed stop, the second ends the run
    there, without waiting for the step or saving, and it says so."""
    cmd, env = command(arith_dir, tmp_path, 1, "train.max_steps=1000")
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    head = []
    try:
        for line in proc.stdout:
            head.append(line)
            if line.startswith("step 2/"):
                break
        assert proc.poll() is None, "".join(head)[-3000:]  # it ended before step 2
        for sig in (signal.SIGSTOP, signal.SIGINT, signal.SIGTERM, signal.SIGCONT):
            proc.send_signal(sig)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, out[-3000:]
    # the loop takes them in the order the kernel delivered them: either may be the second
    assert re.search(r"stopped by a second SIG(INT|TERM) on rank 0 without saving; sockets closed", out), out[-3000:]
    assert "on signal" not in out and complete_checkpoints(tmp_path) == [], out[-3000:]
    assert "never retrieved" not in out, out[-3000:]  # the stages' shutdown left no unretrieved failure
