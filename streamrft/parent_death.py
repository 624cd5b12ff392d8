"""Children that must not outlive the process that started them (the async placement's engine processes, the
learner's and the engine's warm-up children): Linux's PR_SET_PDEATHSIG sends the child SIGKILL when its parent
dies, however the parent dies (SIGKILL and the OOM killer included, where none of the parent's own cleanup runs).
Imports nothing heavy: a child calls it first."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
# The parent's pid, set in the child's environment by the parent (``child_env``): the kernel sends no signal for a
# parent that died before the child's prctl, so the child compares its parent with this one after it.
PARENT_PID_ENV = "STREAMRFT_PARENT_PID"


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a child that calls ``die_with_parent``: this process's pid added."""
    return {**env, PARENT_PID_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """Receive SIGKILL when the parent dies; exit now (1) if it has died already (its pid, from ``child_env``, is no
    longer this process's parent). Not Linux: nothing happens, and the parent's own shutdown still stops us."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    expected = os.environ.get(PARENT_PID_ENV)
    if expected and os.getppid() != int(expected):
        print(f"streamrft: the process that started this one (pid {expected}) has ended; exiting",
              file=sys.stderr, flush=True)
        os._exit(1)
