"""User code named by a spec: ``package.module:name`` (imported) or ``path/to/file.py:name`` (loaded
from the file). Reward functions (``reward.sources[].fn``) and environments (``env.name``) are both
found this way; each caller checks its own spec format first and words its errors with ``prefix``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def load_user_object(spec: str, prefix: str, kind: str) -> Any:
    """The callable ``name`` of ``target:name``. ValueError, starting with ``prefix`` (e.g. "reward
    function spec 'x.py:f'"), when the file or module is missing, has no such name, or it is not
    callable (``kind``: what it should be, "function" or "class")."""
    target, _, name = spec.rpartition(":")
    if target.endswith(".py"):
        module = _load_module_from_file(Path(target), prefix)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise ValueError(
                f"{prefix}: module {target!r} not found ({exc}); check the name and that it is importable "
                "(on PYTHONPATH), or give a path/to/file.py instead"
            ) from None
    obj = getattr(module, name, None)
    if obj is None:
        raise ValueError(f"{prefix}: {target} has no attribute {name!r}")
    if not callable(obj):
        raise ValueError(f"{prefix}: {target}.{name} is a {type(obj).__name__}, not a {kind}")
    return obj


def _load_module_from_file(path: Path, prefix: str):
    if not path.is_file():
        raise ValueError(f"{prefix}: file {path} does not exist (relative to {Path.cwd()})")
    # A unique module name per resolved path so two files both called reward.py do not collide.
    module_name = f"_streamrft_user_{abs(hash(str(path.resolve())))}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{prefix}: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
