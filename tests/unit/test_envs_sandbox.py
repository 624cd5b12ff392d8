"""The Python sandbox (streamrft.envs.sandbox): real child processes, real limits. Every attack ends as
a tool error with its own reason within its limit, the caller goes on, and nothing (process or temp
dir) is left behind."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from streamrft.envs.sandbox import REASONS, SandboxLimits, run_python
from tests.processes import live_processes

REPO = Path(__file__).resolve().parents[2]

# timeout_s is far above cpu_seconds: on a loaded shared machine one CPU second can take several seconds of wall
# time, and the loop must end on its CPU limit, not on the wall clock.
LIMITS = dict(timeout_s=30.0, cpu_seconds=1, memory_mb=256, max_processes=8)

ATTACKS = {
    "infinite loop": ("while True:\n    pass\n", "cpu_limit"),
    "memory bomb": ("chunks = []\nwhile True:\n    chunks.append(bytearray(10 << 20))\n", "memory_limit"),
    "fork bomb": ("import os\nwhile True:\n    os.fork()\n", "process_limit"),
    "write outside": ("open({outside!r}, 'w').write('escaped')\n", "fs_escape"),
    "socket": ("import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM).connect(('127.0.0.1', 9))\n",
               "network_blocked"),
}


def sandbox_processes(marker: str) -> list[int]:
    """Pids of live processes started by the sandbox whose config mentions ``marker`` (the work root)."""
    return live_processes("sandbox_child.py", marker)


@pytest.fixture(scope="module")
def attack_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sandbox_root")
    outside = tmp_path_factory.mktemp("outside") / "escaped.txt"
    limits = SandboxLimits(work_root=str(root), **LIMITS)
    results = {}
    for name, (code, _) in ATTACKS.items():
        results[name] = run_python(code.format(outside=str(outside)), limits)
    return results, root, outside


@pytest.mark.parametrize("name", list(ATTACKS))
def test_each_attack_ends_as_an_error_with_its_reason_within_its_limit(attack_runs, name):
    results, _, _ = attack_runs
    result = results[name]
    assert result.reason == ATTACKS[name][1], (result.reason, result.stderr[-500:])
    assert not result.ok and result.exit_code != 0
    # within its limit: the reason is the limit's own, not the wall clock's
    assert result.seconds < LIMITS["timeout_s"], result.seconds


def test_attack_messages_name_what_was_refused(attack_runs):
    results, _, outside = attack_runs
    assert results["memory bomb"].stderr.endswith("MemoryError: the memory limit (256 MB) was reached\n")
    assert results["write outside"].stderr.endswith(
        f"PermissionError: sandbox: writing {str(outside)!r} outside the work dir is blocked (fs_escape)\n")
    assert results["socket"].stderr.endswith(
        "PermissionError: sandbox: opening a network socket is blocked (network_blocked)\n")
    assert results["fork bomb"].stderr.rstrip().endswith("BlockingIOError: [Errno 11] Resource temporarily unavailable")
    # the traceback points at the tool's code, not at the sandbox's own frames
    assert 'File "<python tool>", line 3, in <module>' in results["fork bomb"].stderr
    assert "sandbox_child" not in results["write outside"].stderr
    assert results["infinite loop"].exit_code == 128 + 24  # SIGXCPU, forwarded by the launcher


def test_five_attacks_in_a_row_leave_no_process_no_temp_dir_and_count_by_reason(attack_runs):
    results, root, outside = attack_runs
    assert Counter(r.reason for r in results.values()) == Counter(
        {"cpu_limit": 1, "memory_limit": 1, "process_limit": 1, "fs_escape": 1, "network_blocked": 1})
    assert set(Counter(r.reason for r in results.values())) <= set(REASONS)
    assert not outside.exists()
    assert os.listdir(root) == []
    assert sandbox_processes(str(root)) == []
    # the caller goes on: the next run is an ordinary one
    after = run_python("print(sum(range(10)))", SandboxLimits(work_root=str(root), **LIMITS))
    assert (after.ok, after.reason, after.stdout, after.exit_code) == (True, "ok", "45\n", 0)


def test_a_sleeping_run_is_killed_at_the_wall_clock(tmp_path):
    start = time.monotonic()
    result = run_python("import time\nprint('started', flush=True)\ntime.sleep(60)\n",
                        SandboxLimits(timeout_s=3.0, work_root=str(tmp_path)))
    assert (result.reason, result.ok, result.exit_code, result.stdout) == ("timeout", False, None, "started\n")
    assert 3.0 <= time.monotonic() - start < 6.0
    assert os.listdir(tmp_path) == [] and sandbox_processes(str(tmp_path)) == []


def test_the_code_works_in_its_own_dir_and_a_caught_escape_still_counts(tmp_path):
    code = ("open('notes.txt', 'w').write('kept')\n"
            "print(open('notes.txt').read(), sorted(__import__('os').listdir('.')))\n"
            "try:\n    open('/etc/hostname', 'a')\nexcept PermissionError as e:\n    print('caught')\n")
    result = run_python(code, SandboxLimits(work_root=str(tmp_path)))
    assert result.stdout == "kept ['notes.txt']\ncaught\n"
    assert (result.exit_code, result.reason, result.ok) == (0, "fs_escape", False)
    assert os.listdir(tmp_path) == []


def test_file_size_limit_and_output_truncation(tmp_path):
    big = run_python("open('big.bin', 'wb').write(b'x' * (3 << 20))\n",
                     SandboxLimits(file_size_mb=1, work_root=str(tmp_path)))
    assert big.reason == "file_limit" and big.stderr.endswith("OSError: [Errno 27] File too large\n")
    loud = run_python("print('x' * 100000)\nimport sys\nsys.stderr.write('e' * 500 + 'END')\n",
                      SandboxLimits(max_output_bytes=100, work_root=str(tmp_path)))
    assert loud.ok and loud.truncated
    # stdout keeps its head (100001 bytes with the newline), stderr its tail (503 bytes)
    assert loud.stdout == "x" * 100 + "\n[... 99901 bytes cut: output limit 100 bytes ...]"
    assert loud.stderr == "[... 403 bytes cut: output limit 100 bytes ...]\n" + "e" * 97 + "END"


def test_a_process_that_leaves_the_group_dies_with_the_run(tmp_path):
    probe = run_python("pass", SandboxLimits(work_root=str(tmp_path)))
    if probe.isolation.get("pidns") != "yes":
        pytest.skip(f"no PID namespace here ({probe.isolation}): a setsid child could outlive the group kill")
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
            "print('parent done')\n")
    start = time.monotonic()
    result = run_python(code, SandboxLimits(work_root=str(tmp_path)))
    assert (result.reason, result.stdout) == ("ok", "parent done\n")
    assert time.monotonic() - start < 3.0
    time.sleep(0.2)
    assert sandbox_processes(str(tmp_path)) == []


CALLER = """
import sys
from streamrft.envs.sandbox import SandboxLimits, run_python
run_python("import time\\ntime.sleep(60)\\n", SandboxLimits(timeout_s=120.0, work_root=sys.argv[1]))
"""


def test_a_killed_caller_leaves_no_sandboxed_code_running(tmp_path):
    """The caller (an environment service) dies by SIGKILL while the code sleeps, so its wall-clock kill never comes:
    every process of the run dies with it (PR_SET_PDEATHSIG), where the sleep used to go on for its 60 s."""
    caller = subprocess.Popen([sys.executable, "-c", CALLER, str(tmp_path)], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 60
        while len(sandbox_processes(str(tmp_path))) < 2:  # the launcher and the worker (and a namespace's init)
            assert caller.poll() is None and time.monotonic() < deadline, "the sandbox never started"
            time.sleep(0.05)
        time.sleep(0.5)  # the worker is past its own set-up and sleeping in the code
    finally:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + 10
    while sandbox_processes(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes(str(tmp_path)) == []


def test_network_namespace_stops_what_the_audit_hook_cannot_see(tmp_path):
    """A program started by the code (bash's /dev/tcp) is outside the audit hook; the network
    namespace still gives it no route to the host's loopback."""
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    probe = run_python("pass", SandboxLimits(work_root=str(tmp_path)))
    if probe.isolation.get("network") != "netns":
        pytest.skip(f"no network namespace here ({probe.isolation})")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = f"import os\nprint(os.system(\"bash -c 'echo hi > /dev/tcp/127.0.0.1/{port}' 2>/dev/null\") != 0)\n"
    result = run_python(code, SandboxLimits(work_root=str(tmp_path)))
    server.setblocking(False)
    with pytest.raises(BlockingIOError):  # a connection that had reached the host would wait in the backlog
        server.accept()
    server.close()
    assert (result.stdout, result.reason) == ("True\n", "ok")
    # the same program outside the sandbox does connect (the check above can fail)
    with socket.socket() as again:
        again.bind(("127.0.0.1", 0))
        again.listen(1)
        os.system(f"bash -c 'echo hi > /dev/tcp/127.0.0.1/{again.getsockname()[1]}'")
        again.settimeout(5)
        again.accept()[0].close()


def test_without_namespaces_the_audit_hook_still_blocks_sockets(tmp_path):
    result = run_python("import socket\nsocket.create_connection(('127.0.0.1', 9))\n",
                        SandboxLimits(namespaces=False, work_root=str(tmp_path)))
    assert result.isolation["network"] == "audit_hook" and result.isolation["pidns"] == "no"
    assert result.reason == "network_blocked"
    assert result.stderr.endswith("PermissionError: sandbox: socket getaddrinfo is blocked (network_blocked)\n")


def test_limits_are_checked_with_their_names():
    with pytest.raises(ValueError, match=r"env.kwargs.limits: unknown sandbox limit\(s\) \['cpu'\]; accepted: "
                                         r"\['timeout_s', 'cpu_seconds'"):
        SandboxLimits.from_dict({"cpu": 1}, where="env.kwargs.limits")
    with pytest.raises(ValueError, match=r"env.kwargs.limits: sandbox limit memory_mb=0 must be a number > 0"):
        SandboxLimits.from_dict({"memory_mb": 0}, where="env.kwargs.limits")
    with pytest.raises(ValueError, match=r"sandbox limit max_processes=2.5 must be a whole number"):
        SandboxLimits(max_processes=2.5)
    assert SandboxLimits.from_dict({"timeout_s": 2}).timeout_s == 2


def test_the_run_ends_like_a_script_threads_joined_and_atexit_run(tmp_path):
    code = ("import atexit, sys, threading, time\natexit.register(lambda: print('atexit'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\nprint('main')\n")
    result = run_python(code, SandboxLimits(work_root=str(tmp_path)))
    assert (result.reason, result.stdout) == ("ok", "main\nthread\natexit\n")
    code = "import sys\nprint('partial')\nsys.exit('bad input')\n"
    result = run_python(code, SandboxLimits(work_root=str(tmp_path)))
    assert (result.reason, result.exit_code, result.stdout, result.stderr) == ("error", 1, "partial\n", "bad input\n")


def test_words_the_code_writes_on_the_marker_pipe_cannot_make_the_run_raise(tmp_path):
    """The worker holds the marker pipe (its audit hook reports there): a malformed word must be ignored."""
    code = ("import os\n"
            "for fd in range(3, 64):\n"
            "    try:\n"
            "        os.write(fd, b'isolation:bogus\\nisolation:\\n')\n"
            "    except OSError:\n"
            "        pass\n"
            "print('done')\n")
    result = run_python(code, SandboxLimits(work_root=str(tmp_path)))
    assert result.reason == "ok" and result.stdout == "done\n", result
    assert "bogus" not in result.isolation and "" not in result.isolation
