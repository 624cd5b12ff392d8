"""compile_cache_dir (streamrft/compile_cache.py): Inductor and Triton are pointed at one kept directory before
anything compiles; a second process compiling the same graph loads it from there (FX-graph cache hit), and a process
of another CPU vector instruction set compiles its own."""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import torch

from streamrft.compile_cache import INDUCTOR_ENV, TRITON_ENV, apply_compile_cache, cache_env, cpu_kernel_key
from streamrft.config import ConfigError, load_config, validate_config

ROOT = Path(__file__).resolve().parents[2]
CPU = cpu_kernel_key()


@pytest.fixture
def env(monkeypatch):
    # registered with monkeypatch so the variables the code sets are restored after the test
    monkeypatch.setenv(INDUCTOR_ENV, "/somewhere/else")
    monkeypatch.delenv(TRITON_ENV, raising=False)
    return os.environ


def test_apply_sets_both_caches_under_the_dir(tmp_path, env):
    got = apply_compile_cache(str(tmp_path / "cc"))
    assert got == {INDUCTOR_ENV: str(tmp_path / "cc" / "inductor" / CPU), TRITON_ENV: str(tmp_path / "cc" / "triton")}
    assert env[INDUCTOR_ENV] == got[INDUCTOR_ENV] and env[TRITON_ENV] == got[TRITON_ENV]  # the key wins
    assert (tmp_path / "cc" / "inductor" / CPU).is_dir() and (tmp_path / "cc" / "triton").is_dir()


def test_the_cpu_key_names_torchs_capability():
    capability = torch.backends.cpu.get_cpu_capability().lower()
    assert CPU in (f"cpu-{capability}", f"cpu-{capability}-amx")
    assert CPU.endswith("-amx") == (capability.startswith("avx512") and torch.cpu._is_amx_tile_supported())


def test_empty_leaves_the_environment(env):
    assert apply_compile_cache("") == {}
    assert env[INDUCTOR_ENV] == "/somewhere/else" and TRITON_ENV not in env


def test_relative_and_home_paths_become_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert cache_env("kc", "cpu-avx2")[INDUCTOR_ENV] == str(tmp_path / "kc" / "inductor" / "cpu-avx2")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert cache_env("~/c", "cpu-avx2")[TRITON_ENV] == str(tmp_path / "h" / "c" / "triton")


def test_a_file_in_the_way_is_a_config_error_before_any_model(tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("x")
    (tmp_path / "c.yaml").write_text("reward:\n  sources:\n    - {name: c, type: rule, fn: gsm8k}\n")
    cfg = load_config(tmp_path / "c.yaml", [f"compile_cache_dir={blocker / 'cache'}"])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, 1, check_paths=False)
    assert str(err.value) == (f"compile_cache_dir={str(blocker / 'cache')!r}: {blocker} exists and is not a "
                              "directory; give a directory (it is created) or '' for the compilers' own cache dirs")


def test_build_run_applies_it_first(tmp_path, env):
    """build_run sets the variables before it builds anything (here it then fails on the missing data file)."""
    from streamrft.compose import build_run
    from streamrft.runtime.distributed import DistInfo

    (tmp_path / "c.yaml").write_text("seed: 0\n")
    cfg = load_config(tmp_path / "c.yaml", [f"compile_cache_dir={tmp_path / 'kept'}",
                                            f"data.train_path={tmp_path / 'missing.jsonl'}"])
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(Exception):
        build_run(cfg, dist)
    assert env[INDUCTOR_ENV] == str(tmp_path / "kept" / "inductor" / CPU)


_COMPILE = textwrap.dedent("""
    import json, sys, torch
    from streamrft.compile_cache import apply_compile_cache
    from streamrft.config import load_config
    cfg = load_config(sys.argv[1], ["compile_cache_dir=" + sys.argv[2]])
    apply_compile_cache(cfg.compile_cache_dir)
    import torch._inductor.config as ic
    ic.compile_threads = 1
    f = torch.compile(lambda x: (x * 3.0).sin() + x.cos(), backend="inductor")
    y = f(torch.arange(67, dtype=torch.float32))  # vectorised, with a tail
    from torch._dynamo.utils import counters
    print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"],
                      "miss": counters["inductor"]["fxgraph_cache_miss"], "y1": float(y[1])}))
""")


@pytest.mark.slow
def test_a_second_process_reuses_the_compiled_graph_and_another_cpu_isa_compiles_its_own(tmp_path):
    (tmp_path / "c.yaml").write_text("seed: 0\n")
    script = tmp_path / "compile.py"
    script.write_text(_COMPILE)
    env = {k: v for k, v in os.environ.items() if k not in (INDUCTOR_ENV, TRITON_ENV, "ATEN_CPU_CAPABILITY")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")

    def run(**extra):
        p = subprocess.run([sys.executable, str(script), str(tmp_path / "c.yaml"), str(tmp_path / "cache")],
                           capture_output=True, text=True, env={**env, **extra}, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    expected = math.sin(3.0) + math.cos(1.0)
    first = run()
    assert (first["hit"], first["miss"]) == (0, 1)  # cold: compiled, written under the key's directory
    assert first["y1"] == pytest.approx(expected, abs=1e-6)
    assert any((tmp_path / "cache" / "inductor" / CPU).rglob("*")), f"nothing written under inductor/{CPU}"
    second = run()
    assert (second["hit"], second["miss"]) == (1, 0)  # warm: the first process's graph, loaded
    assert second["y1"] == first["y1"]
    if CPU == "cpu-default":
        return  # no vector instruction set here to differ from
    # Scalar kernels: the graph's cache key is the same, and the vectorised source in inductor/CPU failed to compile
    # under them ("'at::vec' has not been declared") before Inductor's directory was one per instruction set.
    scalar = run(ATEN_CPU_CAPABILITY="default")
    assert (scalar["hit"], scalar["miss"]) == (0, 1)
    assert scalar["y1"] == pytest.approx(expected, abs=1e-6)
    assert any((tmp_path / "cache" / "inductor" / "cpu-default").rglob("*"))
