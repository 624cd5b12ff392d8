"""streamrft/cuda_preinit.py: the compile warm-up child makes its CUDA context through the driver API in a background
thread while it imports. No GPU here, so a stand-in driver library is built from C with the three calls' documented
signatures and result codes (CUDA Driver API: cuInit, cuDeviceGet, cuDevicePrimaryCtxRetain; CUresult 0 is
CUDA_SUCCESS, 3 CUDA_ERROR_NOT_INITIALIZED, 101 CUDA_ERROR_INVALID_DEVICE)."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from streamrft.cuda_preinit import CudaPreinit

FAKE_DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static int initialised = 0;

int cuInit(unsigned int flags) {  /* as slow as a real driver's first call, in C: the caller's GIL is released */
    const char *loading = getenv("CUDA_MODULE_LOADING");  /* a real driver reads it here, once */
    FILE *log = fopen(getenv("FAKE_CUDA_LOG"), "a");
    fprintf(log, "cuInit with CUDA_MODULE_LOADING=%s\n", loading ? loading : "(unset)");
    fclose(log);
    usleep(atoi(getenv("FAKE_CUINIT_MS")) * 1000);
    if (flags != 0) return 1;
    initialised = 1;
    return 0;
}

int cuDeviceGet(int *device, int ordinal) {
    if (!initialised) return 3;
    if (ordinal < 0 || ordinal >= 2) return 101;  /* two visible devices */
    *device = 10 + ordinal;
    return 0;
}

int cuDevicePrimaryCtxRetain(void **context, int device) {
    if (device != 10 && device != 11) return 101;
    *context = (void *)0x1000;
    FILE *log = fopen(getenv("FAKE_CUDA_LOG"), "a");
    fprintf(log, "retained device %d\n", device);
    fclose(log);
    return 0;
}
"""


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in driver library")
    folder = tmp_path_factory.mktemp("fake_cuda")
    (folder / "fake_cuda.c").write_text(FAKE_DRIVER)
    library = folder / "libfakecuda.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(folder / "fake_cuda.c")], check=True)
    return library


@pytest.fixture
def driver_env(monkeypatch, tmp_path):
    log = tmp_path / "calls.log"
    monkeypatch.setenv("FAKE_CUDA_LOG", str(log))
    monkeypatch.setenv("FAKE_CUINIT_MS", "300")
    # unset, and restored after the test: CudaPreinit sets it in this process's environment
    monkeypatch.setenv("CUDA_MODULE_LOADING", "")
    monkeypatch.delenv("CUDA_MODULE_LOADING")
    return log


def test_the_context_of_the_ranks_device_is_made_in_the_background(fake_driver, driver_env, monkeypatch):
    preinit = CudaPreinit(1, library=str(fake_driver)).wait()
    assert preinit.status == "ok"
    assert preinit.seconds >= 0.3  # the stand-in's cuInit
    # lazy module loading, as torch asks for, set before cuInit read it; then cuDeviceGet(1)'s device, retained
    assert driver_env.read_text() == "cuInit with CUDA_MODULE_LOADING=LAZY\nretained device 11\n"
    assert preinit.report() == {"cuda_preinit": "ok", "cuda_preinit_s": preinit.seconds}


def test_a_module_loading_mode_the_user_set_is_kept(fake_driver, driver_env, monkeypatch):
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    assert CudaPreinit(0, library=str(fake_driver)).wait().status == "ok"
    assert driver_env.read_text() == "cuInit with CUDA_MODULE_LOADING=EAGER\nretained device 10\n"


def test_the_imports_go_on_while_the_driver_initialises(fake_driver, driver_env, monkeypatch):
    """The point of the thread: ctypes releases the GIL for the driver call, so the process's Python work (its
    imports) runs beside it rather than after it."""
    monkeypatch.setenv("FAKE_CUINIT_MS", "2000")
    preinit = CudaPreinit(0, library=str(fake_driver))
    started = time.perf_counter()
    sum(i * i for i in range(300_000))  # Python work of ~0.1 s on this machine
    took = time.perf_counter() - started
    assert preinit.status == "running" and took < 1.5, took  # it did not wait for the 2 s call
    assert preinit.wait().status == "ok"


@pytest.mark.parametrize("ordinal, library, status", [
    (5, "fake", "cuDeviceGet(5) returned CUresult 101"),  # LOCAL_RANK past the visible devices
    (0, "/nonexistent/libcuda.so.1", "no CUDA driver: "),
])
def test_a_failure_is_recorded_and_left_to_torch(fake_driver, driver_env, ordinal, library, status):
    preinit = CudaPreinit(ordinal, library=str(fake_driver) if library == "fake" else library).wait()
    assert preinit.status.startswith(status), preinit.status
    assert "retained" not in (driver_env.read_text() if driver_env.exists() else "")  # nothing was retained
    assert preinit.seconds is not None
