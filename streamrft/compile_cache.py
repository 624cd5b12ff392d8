"""``compile_cache_dir``: where compiled kernels are kept, so a later run skips compiling them.

Two compilers run in a GPU run: torch.compile (Inductor) for the fused LM-head log-probs (``train.compile_head``)
and the decoder layers (``train.compile_layers``, compiled at the learner's first forward, after this is applied)
and Triton for the static-cache engine's decode kernels (``engine.decode_kernels``). Both keep their output on
disk and reuse it: Inductor's FX-graph cache under ``TORCHINDUCTOR_CACHE_DIR`` (its default is
``/tmp/torchinductor_$USER``), Triton's under ``TRITON_CACHE_DIR`` (default ``~/.triton/cache``). Those
defaults are per user and per machine, and ``/tmp`` is often wiped; a directory on a kept volume makes a new
machine's first step start warm.

Inductor's subdirectory is one per CPU vector instruction set (``cpu_kernel_key``): its FX-graph cache key holds the
GPU's name but not the CPU's instruction set, and a graph's C++ source is generated for the one Inductor picks
(``ATEN_CPU_CAPABILITY`` and the CPU's flags). A kept directory that machines of two CPU types share, or one run with
``ATEN_CPU_CAPABILITY`` set, would then load source vectorised for another width: it failed to compile (AVX2 source
under ``default``) or, in one test, gave NaN (AVX2 forced over a cache written by AVX-512 machines:
benchmarks/NOTES.md v29, v30).

Why environment variables: both compilers read them lazily, at their first compile in the process, and child
processes (the async placement's engine processes) inherit them; setting them at the start of the run, before
any model is built, covers every compile. The key wins over variables already set (it was written on purpose).
"""

from __future__ import annotations

import os
from pathlib import Path

from streamrft.config.base import ConfigError

INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_ENV = "TRITON_CACHE_DIR"


def cpu_kernel_key() -> str:
    """The CPU vector instruction set Inductor generates C++ kernels for in this process: "cpu-" and torch's CPU
    capability (which honours ``ATEN_CPU_CAPABILITY``), "-amx" where AVX-512 comes with AMX tiles (Inductor then
    picks AMX). E.g. "cpu-avx2", "cpu-avx512-amx", "cpu-default"."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability().lower()
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    if capability.startswith("avx512") and amx():
        capability += "-amx"
    return "cpu-" + capability


def cache_env(root: str, cpu_key: str) -> dict[str, str]:
    """The variables ``compile_cache_dir=root`` sets: one subdirectory per compiler, Inductor's one per
    ``cpu_key`` (``cpu_kernel_key``; module docstring) (absolute paths)."""
    base = Path(root).expanduser().absolute()
    return {INDUCTOR_ENV: str(base / "inductor" / cpu_key), TRITON_ENV: str(base / "triton")}


def check_compile_cache_dir(root: str) -> None:
    """ConfigError when ``compile_cache_dir`` cannot be a directory (only raises; "" = the compilers' defaults)."""
    if not root:
        return
    base = Path(root).expanduser().absolute()
    for p in (base, *base.parents):  # the nearest existing ancestor decides
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"compile_cache_dir={root!r}: {p} exists and is not a directory; "
                                  "give a directory (it is created) or '' for the compilers' own cache dirs")
            if not os.access(p, os.W_OK | os.X_OK):
                raise ConfigError(f"compile_cache_dir={root!r}: {p} is not writable by this user")
            return


def apply_compile_cache(root: str, environ=os.environ) -> dict[str, str]:
    """Create the cache directories and point Inductor and Triton at them in this process (and its children).

    Returns the variables set ({} for root "": the environment is left as it is)."""
    if not root:
        return {}
    check_compile_cache_dir(root)
    env = cache_env(root, cpu_kernel_key())
    for path in env.values():
        os.makedirs(path, exist_ok=True)
    environ.update(env)
    return env
