"""A real service subprocess for integration tests (``serve-env``, ``serve-reward``, ``serve-teacher``): started
with ``python -m``, its output lines collected by a reader thread, ready once it prints ``<name>: ready``.

One class for every service test, so a readiness wait widened for the loaded 2-core CI machine is widened
everywhere at once; a test file that needs more (the reward service's request log) subclasses it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from typing import Callable, Sequence

import pytest

from tests.integration.conftest import REPO


class ServiceProcess:
    """``python -m COMMAND...``, whose log lines start with ``NAME: ``. The constructor returns once the service
    printed ``NAME: ready`` and is still running; otherwise it kills it and fails the test with its output."""

    def __init__(self, name: str, command: Sequence[str], ready_timeout_s: float = 90.0,
                 stop_timeout_s: float = 15.0) -> None:
        # 90 s by default: start-up imports torch, which is slow on a loaded 2-core machine (20 s failed there)
        self.name = name
        self.stop_timeout_s = stop_timeout_s
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", *command], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(ready_timeout_s):
            self.stop(signal.SIGKILL)
            raise AssertionError(f"{name} not ready in {ready_timeout_s:.0f} s; output: {self.lines}")
        if self.proc.poll() is not None:  # the reader also wakes the wait when the process exits before "ready"
            self.stop(signal.SIGKILL)
            raise AssertionError(f"{name} exited with {self.proc.returncode} before it was ready; output: {self.lines}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith(f"{self.name}: ready"):
                self._ready.set()
        self._ready.set()  # exited: stop waiting

    def address(self, scheme: str) -> str:
        """The address the service printed for ``scheme`` (``tcp`` or ``http``): the bound port of a ``:0`` bind."""
        for line in self.lines:
            m = re.match(rf"{re.escape(self.name)}: listening on ({scheme}://\S+)", line)
            if m:
                return m.group(1)
        raise AssertionError(f"no {scheme} address in {self.lines}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` (if it still runs) and return its exit status; SIGKILL after ``stop_timeout_s``. Once this
        returns, ``lines`` holds all of its output."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(timeout=5)
        self._reader.join(timeout=5)
        self.proc.stdout.close()
        return rc


def services_fixture(start: Callable[..., ServiceProcess]):
    """A pytest fixture (assign it to a module-level name) that gives ``start`` and SIGKILLs every service it
    started when the test ends, passed or failed."""

    @pytest.fixture
    def services():
        started: list[ServiceProcess] = []

        def start_one(*args: str) -> ServiceProcess:
            started.append(start(*args))
            return started[-1]

        yield start_one
        for svc in started:
            svc.stop(signal.SIGKILL)

    return services
