"""The child side of the Python sandbox (streamrft.envs.sandbox): run as ``python -I sandbox_child.py CONFIG``.

Standard library only and never imported by the framework: it is the program the sandbox starts in a
fresh process. The parent passes a JSON config (work dir, code file, limits, the write end of a "marker"
pipe). The child

1. reads the code, then enters new network and PID namespaces when the kernel lets it (a user namespace
   too when not root): no network interface but a down loopback, and every process of the run dies
   with the namespace's init, even one that left the process group; each process of the chain dies with
   the one that started it (PR_SET_PDEATHSIG, as streamrft/parent_death.py does for a run's children), so a
   caller killed by SIGKILL leaves no code running;
2. forks a worker that drops root (to ``nobody``, keeping only CAP_DAC_READ_SEARCH so the interpreter
   stays readable wherever it is installed: the kernel never applies RLIMIT_NPROC to uid 0), sets the
   resource limits, installs an audit hook, and runs the code in the work dir;
3. reports why the run ended by writing one word per line on the marker pipe (``memory_limit``,
   ``process_limit``, ``file_limit``, ``cpu_limit``, ``network_blocked``, ``fs_escape``, ``signal:N``,
   ``isolation:KEY=VALUE``); the parent turns them into ``SandboxResult.reason``.

The audit hook is a tripwire for Python-level calls (open for writing outside the work dir, socket
creation / connect / bind / name lookups): it raises PermissionError and marks the run, so an attempt
counts even when the code catches the exception. It is not a security boundary by itself (see the
"Sandbox limits" section of docs/agents.md).
"""

import ctypes
import errno
import json
import linecache
import os
import resource
import signal
import socket
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_KEEPCAPS = 8
PR_SET_NO_NEW_PRIVS = 38
CAP_DAC_READ_SEARCH = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
NOBODY = 65534
CODE_NAME = "<python tool>"
# open() flags that mean "this call may change a file".
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# Audit events that change the file system: event -> (indices of path arguments, index of dir_fd or None).
PATH_EVENTS = {
    "os.chmod": ((0,), 2), "os.chown": ((0,), 3), "os.link": ((1,), 3), "os.mkdir": ((0,), 2),
    "os.mkfifo": ((0,), 2), "os.mknod": ((0,), 3), "os.remove": ((0,), 1), "os.rename": ((0, 1), 3),
    "os.rmdir": ((0,), 1), "os.symlink": ((1,), 2), "os.truncate": ((0,), None), "os.utime": ((0,), 3),
    "os.setxattr": ((0,), None), "os.removexattr": ((0,), None),
}
NET_EVENTS = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
              "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo")
WRITABLE_DEVICES = ("/dev/null",)

_libc = ctypes.CDLL(None, use_errno=True)
_marker_fd = -1


def mark(word: str) -> None:
    """One line on the marker pipe (a single short write: atomic, never interleaved between processes)."""
    try:
        os.write(_marker_fd, (word + "\n").encode())
    except OSError:
        pass


def _unshare(flags: int) -> bool:
    return _libc.unshare(flags) == 0


def enter_namespaces() -> tuple[bool, bool, bool]:
    """(network namespace, PID namespace, user namespace) entered. Root needs no user namespace; others
    need one (and keep their uid inside it, mapped to itself)."""
    uid, gid = os.geteuid(), os.getegid()
    user = 0 if uid == 0 else CLONE_NEWUSER
    for flags, net, pid in ((CLONE_NEWNET | CLONE_NEWPID, True, True), (CLONE_NEWNET, True, False)):
        if _unshare(flags | user):
            if user:
                try:
                    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                                       ("gid_map", f"{gid} {gid} 1")):
                        with open(f"/proc/self/{name}", "w") as f:
                            f.write(text)
                except OSError:
                    pass  # unmapped: the uid reads as 65534 inside, the kernel still checks files as uid
            return net, pid, bool(user)
    return False, False, False


def _tasks_of(uid: int) -> int:
    """Tasks (threads count: RLIMIT_NPROC counts tasks) whose real uid is ``uid``, from /proc."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                total += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return total


def drop_root() -> bool:
    """Become ``nobody`` keeping only CAP_DAC_READ_SEARCH (read any file, write none of root's), with
    no_new_privs (no set-uid program can give privileges back). False when the kernel refused."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    if _libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0:
        return False
    try:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    except OSError:
        return False
    data = (Data * 2)()
    data[0].effective = data[0].permitted = 1 << CAP_DAC_READ_SEARCH
    if _libc.capset(ctypes.byref(Header(_LINUX_CAPABILITY_VERSION_3, 0)), data) != 0:
        return False
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    return True


def set_limits(cfg: dict, in_user_ns: bool) -> None:
    mb = 1 << 20
    cpu = int(cfg["cpu_seconds"])
    # Soft limit: SIGXCPU (the run ends as cpu_limit); the hard limit one second later is SIGKILL.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_mb"] * mb, cfg["memory_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_size_mb"] * mb, cfg["file_size_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # RLIMIT_NPROC counts every task of the real uid: in a fresh user namespace only this run's (the
    # launcher, the namespace init and the worker: 3), otherwise all of the uid's on the machine.
    base = 3 if in_user_ns else _tasks_of(os.getuid())
    resource.setrlimit(resource.RLIMIT_NPROC, (base + cfg["max_processes"], base + cfg["max_processes"]))


def _resolve(path, dir_fd=None) -> str:
    path = os.fsdecode(path)
    if dir_fd is not None and not os.path.isabs(path):
        path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    return os.path.realpath(path)


def install_audit_hook(workdir: str) -> None:
    root = os.path.realpath(workdir)

    def inside(path, dir_fd=None) -> bool:
        if isinstance(path, int):
            return True  # an open descriptor: its open() was checked
        real = _resolve(path, dir_fd)
        return real == root or real.startswith(root + os.sep) or real in WRITABLE_DEVICES

    def refuse(reason: str, what: str):
        mark(reason)
        raise PermissionError(f"sandbox: {what} is blocked ({reason})")

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = bool(flags & WRITE_FLAGS) if flags is not None else any(c in (mode or "") for c in "wax+")
            if writing and path is not None and not inside(path):
                refuse("fs_escape", f"writing {os.fsdecode(path)!r} outside the work dir")
        elif event in PATH_EVENTS:
            indices, fd_at = PATH_EVENTS[event]
            dir_fd = args[fd_at] if fd_at is not None and fd_at < len(args) else None
            for i in indices:
                if not inside(args[i], dir_fd if isinstance(dir_fd, int) else None):
                    refuse("fs_escape", f"{event} on {os.fsdecode(args[i])!r} outside the work dir")
        elif event == "socket.__new__":
            if args[1] not in (socket.AF_UNIX,):  # AF_UNIX socketpairs (asyncio's self-pipe) stay allowed
                refuse("network_blocked", "opening a network socket")
        elif event in NET_EVENTS:
            refuse("network_blocked", event.replace("socket.", "socket ", 1))

    sys.addaudithook(hook)


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent``, the process that started it, ends: a killed caller (an environment
    service, even by SIGKILL) leaves no code of a run behind, however long it sleeps. Each process of the chain sets
    it: a fork does not inherit it, and entering a user namespace or changing the user clears it (so the launcher
    sets it after its namespaces, the worker after drop_root). A parent that has ended already: exit now (getppid 0:
    the parent is outside this PID namespace, where the launcher stays alive while its init runs)."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() not in (parent, 0):
        os._exit(1)


def supervise(child: int) -> int:
    """Wait for ``child`` (reaping any orphan handed to us meanwhile); its exit code, 128 + N for a
    signal N, marking the signal and a CPU-limit death."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            return 1
        if pid != child:
            continue
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            mark(f"signal:{sig}")
            used = usage.ru_utime + usage.ru_stime
            if sig == signal.SIGXCPU or (sig == signal.SIGKILL and used >= _cpu_seconds - 0.05):
                mark("cpu_limit")
            return 128 + sig
        return os.WEXITSTATUS(status)


def _exception_reason(exc: BaseException) -> str | None:
    if isinstance(exc, MemoryError):
        return "memory_limit"
    if isinstance(exc, BlockingIOError) and exc.errno == errno.EAGAIN:
        return "process_limit"  # fork / clone refused by RLIMIT_NPROC
    if isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):
        return "process_limit"
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        return "file_limit"  # Python ignores SIGXFSZ, so RLIMIT_FSIZE surfaces as EFBIG
    return None


def _print_traceback(exc: BaseException) -> None:
    """The traceback the code would get run as a script: without this file's frames (the exec call,
    the audit hook, the fork wrapper)."""
    import traceback

    te = traceback.TracebackException.from_exception(exc)
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != __file__])
    sys.stderr.write("".join(te.format()))


def _finish_like_python() -> None:
    """What the interpreter does at a normal exit and os._exit skips: wait for non-daemon threads, run
    atexit functions."""
    threading = sys.modules.get("threading")
    if threading is not None:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
    import atexit

    atexit._run_exitfuncs()


def run_worker(code: str, cfg: dict, in_user_ns: bool) -> None:
    """Never returns: every process of the run (forks of the code included) leaves through os._exit."""
    status = 1
    try:
        os.chdir(cfg["workdir"])
        if os.geteuid() == 0:
            mark("isolation:uid=nobody" if drop_root() else "isolation:uid=root")
        die_with_parent(cfg["_forked_by"])
        set_limits(cfg, in_user_ns)
        sys.dont_write_bytecode = True
        real_fork = os.fork

        def fork():
            try:
                return real_fork()
            except BlockingIOError:
                mark("process_limit")
                raise

        os.fork = fork
        linecache.cache[CODE_NAME] = (len(code), None, code.splitlines(True), CODE_NAME)
        compiled = compile(code, CODE_NAME, "exec")
        install_audit_hook(cfg["workdir"])
        exec(compiled, {"__name__": "__main__", "__builtins__": __builtins__})
        _finish_like_python()
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001  (the code's own failure: report it, never re-raise)
        reason = _exception_reason(exc)
        if reason:
            mark(reason)
        if isinstance(exc, MemoryError):
            exc = None  # drop the traceback's frames (and the memory they hold) before printing
            print(f"MemoryError: the memory limit ({cfg['memory_mb']} MB) was reached", file=sys.stderr)
        else:
            _print_traceback(exc)
        status = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001
                pass
        os._exit(status if 0 <= status < 256 else 1)


_cpu_seconds = 0.0


def main() -> None:
    global _marker_fd, _cpu_seconds
    cfg = json.loads(sys.argv[1])
    _marker_fd = cfg["marker_fd"]
    _cpu_seconds = float(cfg["cpu_seconds"])
    with open(cfg["code_path"], encoding="utf-8") as f:
        code = f.read()
    net, pid_ns, in_user_ns = enter_namespaces() if cfg["namespaces"] else (False, False, False)
    die_with_parent(cfg["parent_pid"])
    mark(f"isolation:network={'netns' if net else 'audit_hook'}")
    mark(f"isolation:pidns={'yes' if pid_ns else 'no'}")
    if pid_ns:
        cfg["_forked_by"] = os.getpid()
        init = os.fork()
        if init:
            os._exit(supervise(init))
        # pid 1 of the new namespace: when it exits, the kernel kills every process left in it.
        die_with_parent(cfg["_forked_by"])
    cfg["_forked_by"] = os.getpid()
    worker = os.fork()
    if worker == 0:
        run_worker(code, cfg, in_user_ns)
    os._exit(supervise(worker))


if __name__ == "__main__":
    main()
