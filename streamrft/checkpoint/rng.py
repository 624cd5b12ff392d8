"""Random-number-generator states as JSON (per rank), and the deterministic-algorithms switch.

Rollout sampling does not use these generators (each sample owns a generator seeded from
(seed, step, prompt, sample), see engines/sampling.py); they matter for anything else drawing random
numbers (dropout, random init of new heads, user reward code using ``random`` or numpy). Saving them
keeps resume exact whatever draws them.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def rng_state() -> dict:
    """This process's torch (CPU and CUDA), python ``random`` and numpy global states, JSON-encodable."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state().tolist(),
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()  # the current device's generator
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def set_deterministic(enabled: bool) -> None:
    """train.deterministic: deterministic kernels everywhere (an op without one raises), for bitwise
    resume and run-to-run checks. On CUDA also fixes cuBLAS workspaces and turns off cuDNN autotuning.
    Call before the first CUDA matmul (cuBLAS reads CUBLAS_WORKSPACE_CONFIG once)."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
