"""streamrft/bytecode.py: a module imported without its .pyc is named, the same module byte-compiled is not, and the
run's warning names the packages and the command that byte-compiles them (only when there is something to say)."""

import importlib
import py_compile
import sys
import warnings
from pathlib import Path

import pytest

from streamrft.bytecode import imported_packages_from_source, modules_from_source, warn_if_imports_from_source


def test_a_module_without_byte_code_is_named_until_it_is_byte_compiled(tmp_path, monkeypatch):
    (tmp_path / "probe_mod_v28.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # PYTHONDONTWRITEBYTECODE=1
    importlib.invalidate_caches()
    try:
        mod = importlib.import_module("probe_mod_v28")
        assert modules_from_source([mod]) == ["probe_mod_v28"]
        py_compile.compile(str(tmp_path / "probe_mod_v28.py"), cfile=mod.__spec__.cached, doraise=True)
        del sys.modules["probe_mod_v28"]
        assert modules_from_source([importlib.import_module("probe_mod_v28")]) == []
    finally:
        sys.modules.pop("probe_mod_v28", None)


def test_the_warning_names_the_packages_and_the_command():
    import torch

    with pytest.warns(UserWarning) as caught:
        text = warn_if_imports_from_source(["torch", "torch._dynamo", "tests.unit"])
    assert str(caught[0].message) == text
    assert text.startswith("torch, torch._dynamo, tests.unit compiled from source at import: there is no .pyc byte "
                           "code where Python looks for it")
    # one directory per install that holds them: torch's site-packages once, and the repository (tests' parent)
    site, repo = Path(torch.__file__).parents[1], Path(__file__).resolve().parents[2]
    assert text.endswith(f"python -m compileall -q {site} {repo}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_imports_from_source([]) is None


def test_this_install_has_torchs_byte_code():
    import torch

    # pip wrote the .pyc files at install: nothing to warn about in this venv
    assert modules_from_source([torch]) == [] and "torch" not in imported_packages_from_source()
