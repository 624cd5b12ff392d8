"""Run untrusted Python in a separate, limited process: ``run_python(code, limits) -> SandboxResult``.

The code runs in a fresh ``python -I`` (isolated mode: no user site, no PYTHON* variables, no script
dir on sys.path) started from :mod:`streamrft.envs.sandbox_child`, in its own process group and a
throwaway work dir that is removed afterwards. Inside, the child enters new network and PID namespaces
when the kernel allows it, drops root, sets RLIMIT_CPU / RLIMIT_AS / RLIMIT_FSIZE / RLIMIT_NPROC and
installs an audit hook against writes outside the work dir and network use (what each layer does and
does not stop: docs/agents.md, "Sandbox limits"). The parent enforces the wall clock: past
``timeout_s`` the whole process group is SIGKILLed. Every run ends with exactly one ``reason``:

``ok``              exit status 0 and nothing refused
``timeout``         the wall clock ran out (sleeping, blocking, or CPU spread over processes)
``cpu_limit``       the worker used its CPU seconds (SIGXCPU, then SIGKILL one second later)
``memory_limit``    an allocation failed under RLIMIT_AS (MemoryError)
``process_limit``   a fork / thread was refused under RLIMIT_NPROC
``file_limit``      a write went past RLIMIT_FSIZE (EFBIG)
``network_blocked`` the code tried to open a network socket, connect, bind or resolve a name
``fs_escape``       the code tried to change a file outside its work dir
``error``           any other failure (an exception, a non-zero exit, a signal)

An attempt that the code catches still sets the reason (``ok`` is False): the attempt is what is
reported. When several apply, the first in the order fs_escape, network_blocked, memory_limit,
process_limit, file_limit, cpu_limit, timeout, error wins (a fork bomb killed by the wall clock is a
process_limit).
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields

REASONS = ("ok", "timeout", "cpu_limit", "memory_limit", "process_limit", "file_limit", "network_blocked",
           "fs_escape", "error")
# Which reason wins when a run shows several (escape attempts first: they are what a reader must see).
_PRECEDENCE = ("fs_escape", "network_blocked", "memory_limit", "process_limit", "file_limit", "cpu_limit")
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
WORK_PREFIX = "streamrft-sandbox-"
NOBODY = 65534
# After the worker exits (or is killed), how long to keep reading output that is still in the pipes.
_DRAIN_S = 1.0


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run. Every value must be > 0 (``work_root``: "" = the system temp dir)."""

    timeout_s: float = 10.0  # wall clock for the whole run, startup included
    cpu_seconds: int = 5  # CPU time of the worker process (RLIMIT_CPU)
    memory_mb: int = 512  # address space per process (RLIMIT_AS)
    file_size_mb: int = 16  # largest file a process may write (RLIMIT_FSIZE)
    max_processes: int = 16  # processes + threads the code may add (RLIMIT_NPROC)
    max_output_bytes: int = 16384  # stdout and stderr are each cut to this many bytes
    work_root: str = ""  # where the throwaway work dirs are made
    namespaces: bool = True  # try network + PID namespaces (False: audit hook and process group only)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("work_root", "namespaces"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"sandbox limit {f.name}={value!r} must be a number > 0")
            if f.name != "timeout_s" and value != int(value):
                raise ValueError(f"sandbox limit {f.name}={value!r} must be a whole number")
        if self.work_root and not os.path.isdir(self.work_root):
            raise ValueError(f"sandbox limit work_root={self.work_root!r} is not an existing directory")

    @classmethod
    def from_dict(cls, values: dict | None, where: str = "limits") -> "SandboxLimits":
        """From a config mapping; an unknown key is an error naming ``where`` and the accepted keys."""
        values = dict(values or {})
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"{where}: unknown sandbox limit(s) {unknown}; accepted: {known}")
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


@dataclass
class SandboxResult:
    ok: bool
    stdout: str
    stderr: str
    reason: str  # one of REASONS
    exit_code: int | None = None  # the launcher's exit status (128 + N: signal N); None when killed
    seconds: float = 0.0  # wall clock of the run
    truncated: bool = False  # stdout or stderr was cut to max_output_bytes
    isolation: dict = field(default_factory=dict)  # what the child could set up: network, pidns, uid


class _Capture:
    """Bounded output: the head of stdout (where answers are) or the tail of stderr (where the
    traceback's last line is); the bytes past the bound are counted, not kept."""

    def __init__(self, limit: int, keep_tail: bool) -> None:
        self.limit, self.keep_tail = limit, keep_tail
        self.data = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        excess = len(self.data) - self.limit
        if excess > 0:
            self.dropped += excess
            if self.keep_tail:
                del self.data[:excess]
            else:
                del self.data[self.limit:]

    def text(self) -> str:
        body = self.data.decode("utf-8", errors="replace")
        if not self.dropped:
            return body
        note = f"[... {self.dropped} bytes cut: output limit {self.limit} bytes ...]"
        return f"{note}\n{body}" if self.keep_tail else f"{body}\n{note}"


def _remove_tree(path: str) -> None:
    """rmtree that also removes what the code made unreadable (chmod 000 dirs)."""

    def fix(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), stat.S_IRWXU)
            os.chmod(p, stat.S_IRWXU)
        except OSError:
            pass
        func(p)

    shutil.rmtree(path, onerror=fix)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _exited(pid: int) -> bool:
    """Has ``pid`` exited? Without reaping it, so its pid (the group id) cannot be reused before the
    group is killed."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` under ``limits``; blocking (call it through a thread from async code). Never raises
    for anything the code does; raises OSError only when no process can be started at all."""
    limits = limits or SandboxLimits()
    start = time.monotonic()
    base = tempfile.mkdtemp(prefix=WORK_PREFIX, dir=limits.work_root or None)
    marker_r = marker_w = -1
    try:
        # base (0711) holds the code file (readable by the launcher only) and the work dir; as root the
        # work dir belongs to nobody, the uid the code runs as.
        os.chmod(base, 0o711)
        workdir = os.path.join(base, "work")
        os.mkdir(workdir, 0o700)
        if os.geteuid() == 0:
            os.chown(workdir, NOBODY, NOBODY)
        code_path = os.path.join(base, "code.py")
        with open(os.open(code_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
            f.write(code)
        marker_r, marker_w = os.pipe()
        config = {
            "workdir": workdir, "code_path": code_path, "marker_fd": marker_w,
            "cpu_seconds": int(limits.cpu_seconds), "memory_mb": int(limits.memory_mb),
            "file_size_mb": int(limits.file_size_mb), "max_processes": int(limits.max_processes),
            "namespaces": bool(limits.namespaces), "parent_pid": os.getpid(),
        }
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-I", _CHILD, json.dumps(config)], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(marker_w,), cwd=workdir, env=env,
            start_new_session=True,
        )
        os.close(marker_w)
        marker_w = -1
        out, err, markers, timed_out = _collect(proc, marker_r, limits, start)
        marker_r = -1  # closed by _collect
    finally:
        for fd in (marker_r, marker_w):
            if fd >= 0:
                os.close(fd)
        _remove_tree(base)
    exit_code = None if timed_out else proc.returncode
    words = set(markers.decode("utf-8", errors="replace").split())
    # The code can write to the marker pipe too (its audit hook writes there): read only well-formed words,
    # so nothing it writes makes this raise.
    isolation = dict(w[len("isolation:"):].split("=", 1) for w in words if w.startswith("isolation:") and "=" in w)
    reason = next((r for r in _PRECEDENCE if r in words), None)
    if reason is None:
        reason = "timeout" if timed_out else ("error" if exit_code != 0 else "ok")
    return SandboxResult(
        ok=reason == "ok", stdout=out.text(), stderr=err.text(), reason=reason, exit_code=exit_code,
        seconds=time.monotonic() - start, truncated=bool(out.dropped or err.dropped), isolation=isolation,
    )


def _collect(proc: subprocess.Popen, marker_r: int, limits: SandboxLimits, start: float):
    """Read stdout, stderr and the marker pipe until the run is over; kill the group at the deadline
    or as soon as the launcher exits (nothing the code left behind outlives the run)."""
    out = _Capture(limits.max_output_bytes, keep_tail=False)
    err = _Capture(limits.max_output_bytes, keep_tail=True)
    markers = bytearray()
    sel = selectors.DefaultSelector()
    sinks = {proc.stdout.fileno(): out.add, proc.stderr.fileno(): err.add,
             marker_r: lambda b: markers.extend(b[: max(0, 65536 - len(markers))])}
    for fd in sinks:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline = start + limits.timeout_s
    timed_out = False
    killed_at = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if killed_at is None and (now >= deadline or _exited(proc.pid)):
                timed_out = now >= deadline and not _exited(proc.pid)
                _kill_group(proc.pid)
                killed_at = now
            if killed_at is not None and now - killed_at > _DRAIN_S:
                break  # a process that left the group still holds a pipe: stop reading, not waiting
            wait = 0.05 if killed_at is None else max(0.0, killed_at + _DRAIN_S - now)
            for key, _ in sel.select(timeout=min(wait, max(0.0, deadline - now)) if killed_at is None else wait):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if chunk:
                    sinks[key.fd](chunk)
                else:
                    sel.unregister(key.fd)
    finally:
        sel.close()
        if killed_at is None:
            _kill_group(proc.pid)
        proc.stdout.close()
        proc.stderr.close()
        os.close(marker_r)
        proc.wait()
    return out, err, bytes(markers), timed_out
