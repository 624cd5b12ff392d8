"""learner/compiling.py preload_compiler: Inductor's compiler is imported in a background thread once the
learner is built (build_run), only when something will compile, and the first compile waits for it; an import
that never finishes fails the compile loudly instead of hanging it."""

import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from streamrft import compose
from streamrft.config.train import TrainConfig
from streamrft.learner import compiling

REPO = Path(__file__).resolve().parents[2]


def test_the_preload_imports_inductor_in_another_thread_and_a_compile_waits_for_it():
    code = """
import sys, threading, torch
from streamrft.learner import compiling
assert "torch._inductor.compile_fx" not in sys.modules
compiling.preload_compiler()
thread = compiling._PRELOAD
assert thread is not None and thread is not threading.current_thread()
compiling.preload_compiler()
assert compiling._PRELOAD is thread  # started once
double = compiling.CompiledOrEager(lambda x: x * 2, "test.compile", "doubling", backend="eager")
assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0))
assert not thread.is_alive() and "torch._inductor.compile_fx" in sys.modules
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def _started_by_build_run(monkeypatch, device: str, **train) -> bool:
    started = []
    monkeypatch.setattr(compiling, "preload_compiler", lambda: started.append(True))
    cfg = SimpleNamespace(train=TrainConfig(**train))
    compose._preload_compiler_if_used(cfg, SimpleNamespace(device=torch.device(device)))
    return bool(started)


def test_build_run_preloads_only_when_the_learner_compiles(monkeypatch):
    assert _started_by_build_run(monkeypatch, "cpu", compile_layers=True, compile_head=False)
    assert not _started_by_build_run(monkeypatch, "cpu", compile_layers="auto", compile_head=True)  # CPU: eager
    assert not _started_by_build_run(monkeypatch, "cpu", compile_layers=False, compile_head=True)
    assert _started_by_build_run(monkeypatch, "cuda", compile_layers=False, compile_head=True)
    assert _started_by_build_run(monkeypatch, "cuda", compile_layers="auto", compile_head=False)
    assert not _started_by_build_run(monkeypatch, "cuda", compile_layers=False, compile_head=False)


def test_a_preload_that_never_finishes_fails_the_compile_naming_the_stage_and_rank(monkeypatch):
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, daemon=True)
    stuck.start()
    monkeypatch.setattr(compiling, "_PRELOAD", stuck)
    monkeypatch.setattr(compiling, "PRELOAD_TIMEOUT_S", 0.2)
    double = compiling.CompiledOrEager(lambda x: x * 2, "test.compile", "doubling", backend="eager")
    try:
        stuck_error = r"did not finish within 0.2 s \(stage: the first train step's compile, rank 0\)"
        with pytest.raises(RuntimeError, match=stuck_error):
            double(torch.ones(2))
        assert double.compiled is None and not double.failed  # nothing compiled, no silent eager fallback
    finally:
        release.set()
        stuck.join(5)
