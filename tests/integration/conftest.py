"""Shared fixtures for integration tests: a prepared tiny arith setup (model, data) per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


# `make test` runs its two groups as two pytest processes at once; both need these fixtures. The folder it names
# here (one per `make test`, removed after it) lets the first process build each one while the other waits, instead
# of both building it on CI's two cores. Unset: each session builds its own.
SHARED_ENV = "STREAMRFT_TEST_SHARED_DIR"
SHARED_BUILD_TIMEOUT_S = 600.0  # the other process's build takes ~20 s on CI


def _prepared(tmp_path_factory, name: str, **kwargs) -> Path:
    """``prepare(**kwargs)`` (pipelines/arith/prepare.py) in a folder of this session: built here, or copied from
    the build another process of the same `make test` made (a test writes files beside the data: each session has
    its own copy)."""
    import fcntl
    import hashlib
    import json
    import os
    import shutil
    import time

    sys.path.insert(0, str(REPO / "pipelines" / "arith"))
    try:
        from prepare import prepare
    finally:
        sys.path.pop(0)
    out = tmp_path_factory.mktemp(name)
    shared = os.environ.get(SHARED_ENV)
    if not shared:
        prepare(str(out), **kwargs)
        return out
    key = hashlib.sha256(json.dumps(kwargs, sort_keys=True).encode()).hexdigest()[:16]
    built, lock_path = Path(shared) / f"{name}-{key}", Path(shared) / f"{name}-{key}.lock"
    with open(lock_path, "w") as lock:
        deadline = time.monotonic() + SHARED_BUILD_TIMEOUT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{lock_path}: another pytest process held this fixture's build for "
                                       f"{SHARED_BUILD_TIMEOUT_S:g} s") from None
                time.sleep(0.2)
        if not (built / ".complete").exists():  # first here, or the process that held the lock died building it
            shutil.rmtree(built, ignore_errors=True)
            prepare(str(built), **kwargs)
            (built / ".complete").touch()
    shutil.copytree(built, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".complete"))
    return out


@pytest.fixture(scope="session")
def arith_dir(tmp_path_factory) -> Path:
    """A tiny warmed-up arith policy and its datasets, built locally (no hub), shared by the session."""
    return _prepared(tmp_path_factory, "arith", seed=0, warmup_steps=150, n_train=600, n_eval=64)


@pytest.fixture(scope="session")
def warm_arith(tmp_path_factory) -> Path:
    """The arith warm-up of 700 steps (about 20 s): the policy where rewards vary within groups, so
    losses are not zero (the step-loop fixture tests/fixtures/step_loop_losses.json was recorded on it)."""
    import json

    fixture = json.loads((REPO / "tests" / "fixtures" / "step_loop_losses.json").read_text())
    return _prepared(tmp_path_factory, "arith700", **fixture["prepare"])


def arith_eval_overrides(folder: Path, rows: int, max_operand: int = 99) -> list[str]:
    """The overrides of a held-out arith split of ``rows`` rows, written in ``folder`` (the fixtures' own has 64):
    a wider evaluation, or a longer one."""
    sys.path.insert(0, str(REPO / "pipelines" / "arith"))
    try:
        from task import write_dataset
    finally:
        sys.path.pop(0)
    path = write_dataset(str(folder / f"eval{rows}.jsonl"), rows, 0, split="eval", max_operand=max_operand)
    return [f"data.eval_path={path}", f"data.eval_size={rows}"]


def arith_overrides(arith_dir: Path, output_dir: Path, *extra: str) -> list[str]:
    """Small, fast settings for tests (a step takes well under a second on one core)."""
    return [
        f"model.path={arith_dir / 'sft'}",
        f"data.train_path={arith_dir / 'train.jsonl'}",
        f"data.eval_path={arith_dir / 'eval.jsonl'}",
        "data.eval_size=32",
        f"output_dir={output_dir}",
        "rollout.prompts_per_step=8",
        "rollout.n_samples_per_prompt=4",
        "rollout.stage_timeout_s=60",
        "train.max_steps=1",
        *extra,
    ]


def sigterm_after_step(cmd: list[str], env: dict, step: int, wait_s: float = 120, new_session: bool = False,
                       target=None) -> tuple[int, str]:
    """Start a training command, send SIGTERM once it prints ``step {step}/``, and return
    (exit code, all output). ``new_session``: a launcher with children (torchrun), killed as a group
    if it outlives the test. ``target``: a function giving the pid to signal (default: the command's)."""
    import os
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=new_session)
    try:
        deadline = time.monotonic() + wait_s
        for line in proc.stdout:
            if line.startswith(f"step {step}/"):
                break
            assert time.monotonic() < deadline, f"no step {step} within {wait_s:.0f} s"
        if target is None:
            proc.send_signal(signal.SIGTERM)
        else:
            os.kill(target(), signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL) if new_session else proc.kill()
            proc.wait(10)
    return proc.returncode, out


def rank_pid(marker: str, rank: int) -> int:
    """The pid of the training process of ``rank`` (RANK in its environment) whose command line holds
    ``marker`` (e.g. its output folder)."""
    import subprocess

    for pid in subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # it ended meanwhile
            continue
        if f"RANK={rank}".encode() in environ and b"streamrft.cli" in cmdline:
            return int(pid)
    raise AssertionError(f"no process of rank {rank} with {marker} on its command line")
