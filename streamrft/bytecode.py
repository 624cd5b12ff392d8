"""Whether this interpreter compiled the run's big packages from their Python source at import.

Python keeps each module's compiled byte code in a ``.pyc`` file (``__pycache__``). pip writes them at install, and
an interpreter writes a missing one at the first import, unless it runs with ``PYTHONDONTWRITEBYTECODE=1`` (common in
container images) or cannot write there. An install without them (uv's default, ``pip --no-compile``) under that
setting compiles every module of torch, Inductor and transformers again at each start, in every process of a run:
the learner, its compile and kernel warm-up children, Inductor's compile workers. On the H100 host of
benchmarks/NOTES.md v28 that was ~6 s of the compile warm-up child's imports and 8-15 s of the time from launch to
the end of the first train step. Nothing here changes the interpreter: a run says so once, with the command that
fixes it.
"""

from __future__ import annotations

import os
import sys
import warnings

# the packages whose imports dominate a run's start, as their modules are named in sys.modules
PACKAGES = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "transformers", "triton")


def modules_from_source(modules) -> list[str]:
    """The names of ``modules`` (imported module objects) compiled from their source: no byte code on disk where
    their spec says it would be (a module loaded from its ``.pyc``, or one that wrote its ``.pyc``, has it)."""
    names = []
    for module in modules:
        cached = getattr(getattr(module, "__spec__", None), "cached", None)
        if cached and not os.path.exists(cached):
            names.append(module.__name__)
    return names


def imported_packages_from_source() -> list[str]:
    """``modules_from_source`` of the ``PACKAGES`` this process has imported."""
    return modules_from_source([sys.modules[name] for name in PACKAGES if name in sys.modules])


def install_dirs(names: list[str]) -> list[str]:
    """The directories that hold the top-level packages of the imported modules ``names`` (where ``compileall``
    is to look), in order and without repeats."""
    dirs = []
    for name in names:
        top = sys.modules.get(name.split(".")[0])
        if getattr(top, "__file__", None):
            where = os.path.dirname(os.path.dirname(top.__file__))  # .../site-packages/torch/__init__.py
            if where not in dirs:
                dirs.append(where)
    return dirs or ["SITE_PACKAGES"]


def warn_if_imports_from_source(names: list[str] | None = None) -> str | None:
    """One warning when the run's packages were compiled from source at import (``names``: the default is
    ``imported_packages_from_source()``); returns its text (None: nothing to say)."""
    names = imported_packages_from_source() if names is None else names
    if not names:
        return None
    text = (f"{', '.join(names)} compiled from source at import: there is no .pyc byte code where Python looks "
            f"for it (PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r} over an install "
            f"without byte code, or a read-only install), so every process of this run compiles them again at its "
            f"start (8-15 s more to the first train step on an H100 host: benchmarks/NOTES.md v28). Byte-compile "
            f"them once: python -m compileall -q {' '.join(install_dirs(names))}")
    warnings.warn(text, stacklevel=2)
    return text
