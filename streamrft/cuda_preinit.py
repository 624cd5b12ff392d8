"""Make a process's CUDA context in a background thread while the process is still importing.

Why: a process's first CUDA call initialises the driver and creates the device's primary context. The compile
warm-up child (learner/compile_warmup.py) pays this after its imports, on the cold first step's critical path.
v25 measured 3.3 s of the child's time outside its other phases on the H200 host, and its imports took 11 s there
(benchmarks/NOTES.md v25). The driver API needs no torch. Called through ctypes, which releases the GIL for the
call, it runs beside the imports. The CUDA runtime that torch uses then finds the primary context already made:
``cuDevicePrimaryCtxRetain`` is the same call the runtime makes, and the driver serialises the two. The driver
reads ``CUDA_MODULE_LOADING`` once, at ``cuInit``, so it is set to LAZY first (unless set), as torch's own CUDA
initialisation does before its first call: otherwise an older driver would load every kernel of every library
into the context at once.

Only a head start: if anything fails (no driver, a device that is not there), the thread records why and stops,
and torch initialises CUDA itself, as it would have. No process waits on the thread (it is a daemon).
``CudaPreinit.wait`` is for a caller that wants the time it took, or to hold off its own first CUDA call until then.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

DRIVER_LIBRARY = "libcuda.so.1"  # the NVIDIA driver's user-space library, as the CUDA runtime loads it


class CudaPreinit:
    """``cuInit`` and the primary context of device ``ordinal``, visible-device numbering (``CUDA_VISIBLE_DEVICES``
    applies, as for torch's ``cuda:ordinal``), made in a daemon thread from construction. ``status`` is "ok" or why
    not, and ``seconds`` how long it took (None while it runs)."""

    def __init__(self, ordinal: int, library: str = DRIVER_LIBRARY):
        self.ordinal = ordinal
        self.library = library
        self.status = "running"
        self.seconds: float | None = None
        self._context = ctypes.c_void_p()  # kept retained for the process's life: the runtime uses the same one
        os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")  # before the thread: cuInit reads it (module docstring)
        self._thread = threading.Thread(target=self._run, name="streamrft-cuda-preinit", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            self.status = self._init()
        except Exception as exc:  # noqa: BLE001 - only a head start: torch initialises CUDA itself after this
            self.status = f"failed: {type(exc).__name__}: {exc}"
        self.seconds = round(time.perf_counter() - started, 3)

    def _init(self) -> str:
        try:
            driver = ctypes.CDLL(self.library)
        except OSError as exc:
            return f"no CUDA driver: {exc}"
        code = driver.cuInit(ctypes.c_uint(0))
        if code != 0:
            return f"cuInit returned CUresult {code}"
        device = ctypes.c_int()
        code = driver.cuDeviceGet(ctypes.byref(device), ctypes.c_int(self.ordinal))
        if code != 0:
            return f"cuDeviceGet({self.ordinal}) returned CUresult {code}"
        code = driver.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), device)
        if code != 0:
            return f"cuDevicePrimaryCtxRetain(device {device.value}) returned CUresult {code}"
        return "ok"

    def wait(self, timeout_s: float = 120.0) -> "CudaPreinit":
        """Until the thread has ended (at most ``timeout_s``: then ``status`` still says "running"); returns self."""
        self._thread.join(timeout_s)
        return self

    def report(self) -> dict:
        """For a result: ``cuda_preinit`` (its status) and ``cuda_preinit_s`` (None: still running)."""
        return {"cuda_preinit": self.status, "cuda_preinit_s": self.seconds}
