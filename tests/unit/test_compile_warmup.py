"""train.compile_warmup (streamrft/learner/compile_warmup.py): a real child process compiles the decoder-layer graph
on a one-layer copy of the model into compile_cache_dir, and a fresh learner of the full model (two layers, other
lengths) then compiles that graph from the cache: Inductor's FX-graph cache hits, no miss. A child that fails or
outlives its wait costs one warning naming the rank and its log; one still importing when the learner compiles is
killed, not waited for; the key resolves only where the learner compiles.

On this CPU the layers compile with Inductor's C++ backend (train.compile_layers=true), one compile thread."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import msgspec
import pytest
import torch
import yaml

from streamrft.config import load_config, validate_config
from streamrft.config.base import ConfigError
from streamrft.config.train import TrainConfig, compile_warmup_enabled
from streamrft.learner import compile_warmup
from tests.processes import live_processes

REPO = Path(__file__).resolve().parents[2]

# The run's learner, in a fresh process: the full model, one train step on a batch of other lengths than the
# child's; prints Inductor's FX-graph cache counters and Dynamo's compiles.
LEARNER = """
import json, sys, torch
from torch._dynamo.utils import counters
from streamrft.compile_cache import apply_compile_cache
from streamrft.config import load_config
from streamrft.learner.actor import ActorUpdate
from streamrft.learner.compiling import compiles_finished
from streamrft.learner.fsdp2 import FSDP2Strategy
from streamrft.learner.synthetic import synthetic_batch
from streamrft.runtime.distributed import all_reduce_sum, init_distributed
cfg = load_config(sys.argv[1])
apply_compile_cache(cfg.compile_cache_dir)
dist = init_distributed()
strategy = FSDP2Strategy(cfg.model, cfg.train, dist, total_steps=2)
actor = ActorUpdate(strategy, None, cfg, all_reduce_sum)
actor.train_step(synthetic_batch(6, 5, 11, strategy.module.config.vocab_size, 3, seed=1))  # 4 rows of 16
print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
                  "compiles": compiles_finished()}))
"""


def _config(tmp_path, model_dir, **train) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "run"), "compile_cache_dir": str(tmp_path / "cache"),
        "model": {"path": model_dir, "dtype": "bfloat16", "attn_implementation": "sdpa"},
        "engine": {"max_new_tokens": 6}, "rollout": {"n_samples_per_prompt": 2, "prompts_per_step": 2},
        "reward": {"sources": [{"name": "correct", "type": "rule", "fn": "gsm8k"}]},
        "train": {"compile_layers": True, "compile_head": False, "compile_warmup": True, "micro_batch_tokens": 64,
                  **train}}))
    return path


def _until(condition, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}")
        time.sleep(0.1)


@pytest.fixture
def one_compile_thread(monkeypatch):
    """Inductor's pool of C++ compile workers costs more than it saves on CI's 2 cores (test_compile_layers.py)."""
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(autouse=True)
def no_active_warmup():
    yield
    compile_warmup.stop_compile_warmup()


def test_the_child_compiles_the_layer_graph_that_the_full_learner_then_reads_from_the_cache(
        tmp_path, model_dir, one_compile_thread):
    cfg_path = _config(tmp_path, model_dir)
    cfg = load_config(cfg_path)
    validate_config(cfg, 1, check_paths=False)
    warm = compile_warmup.start_compile_warmup(cfg, "cpu")
    assert warm is not None and warm.proc.pid != os.getpid()
    assert compile_warmup.start_compile_warmup(cfg, "cpu") is warm  # one per process
    _until(warm.compiling_path.exists, "the child to start compiling")
    result = compile_warmup.wait_for_warmup()  # it is compiling: the learner waits for it
    assert result["status"] == "ok", warm.log_path.read_text()[-3000:]
    assert result["compiles"] >= 1  # the layer graph (forward and backward: one Dynamo compile)
    keys = [key for key, _ in result["compile_log"]]  # each compile in order, named by its setting
    assert len(keys) == result["compiles"] and "train.compile_layers" in keys
    # where its time went: every phase timed, and the compiles inside its one step
    assert all(result[k] >= 0 for k in ("imports_s", "device_s", "model_s", "learner_s"))
    assert 0 < result["compile_seconds"] <= result["seconds"] < result["wall_s"]
    # every compile is in the forward (the backward is lowered with it): the backward after it compiles nothing
    assert result["compile_seconds"] <= result["forward_s"] and result["backward_s"] > 0
    assert result["forward_s"] + result["backward_s"] <= result["seconds"] + 0.002  # each rounded to 1 ms
    assert result["imports_s"] < result["compiling_at_s"] < result["wall_s"]
    # one compile thread (or no Triton, on a CPU): Inductor has no worker pool for the child to start early
    assert result["compile_pool"].startswith("not used") and result["compile_pool_ready_s"] is None
    assert json.loads(warm.result_path.read_text()) == {k: v for k, v in result.items() if k != "wall_s"}
    assert any((tmp_path / "cache" / "inductor").rglob("*")), "the child wrote nothing into compile_cache_dir"
    proc = subprocess.run([sys.executable, "-c", LEARNER, str(cfg_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    learner = json.loads(proc.stdout.strip().splitlines()[-1])
    assert learner["compiles"] >= 1 and learner["hit"] >= 1 and learner["miss"] == 0, learner


def test_a_failing_child_costs_one_warning_naming_the_rank_and_its_log(tmp_path, model_dir):
    cfg = load_config(_config(tmp_path, model_dir))
    cfg.model.path = str(tmp_path / "no-such-model")  # the child cannot build the model
    warm = compile_warmup.start_compile_warmup(cfg, "cpu")
    warm.proc.wait(timeout=300)
    with pytest.warns(UserWarning, match=r"compile warm-up \(rank 0, .*\.log\) failed: ValueError: model.path"):
        result = warm.wait()
    assert result["status"] == "failed" and "no-such-model" in result["reason"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compile_warmup.wait_for_warmup() is result  # reported once; later compiles do not wait


# A child that writes its result as run_child does (atomically), then takes its time to exit (its compile workers'
# and CUDA context's shutdown: 1.7 s on this CPU), here 120 s.
SLOW_EXIT = """
import json, os, sys, time
from pathlib import Path
Path(sys.argv[2]).touch()  # the compiling marker
time.sleep(0.5)
tmp = Path(sys.argv[1] + ".tmp")
tmp.write_text(json.dumps({"status": "ok", "seconds": 0.4, "compiles": 1}))
os.replace(tmp, sys.argv[1])
time.sleep(120)
"""


def test_the_learner_takes_the_result_when_it_is_written_not_when_the_child_has_exited(tmp_path):
    result_path, log_path = tmp_path / "child.json", tmp_path / "child.log"
    marker = compile_warmup.compiling_marker(result_path)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_EXIT, str(result_path), str(marker)], start_new_session=True)
    warm = compile_warmup.CompileWarmup(proc, result_path, log_path, rank=0)
    try:
        _until(marker.exists, "the child to start compiling", timeout_s=60)
        t0 = time.monotonic()
        result = warm.wait(timeout_s=60)
        assert result["status"] == "ok" and result["compiles"] == 1, result
        assert time.monotonic() - t0 < 30 and proc.poll() is None  # taken while the child still runs
        assert warm.waited_s < 30 and result["wall_s"] < 30
        assert warm.wait() is result  # reported once
    finally:
        warm.stop()  # the run's end: the child, still exiting, is killed and reaped
    assert proc.returncode is not None


def test_a_compiling_child_that_outlives_the_wait_is_killed_with_its_compile_workers(tmp_path, model_dir,
                                                                                       one_compile_thread):
    cfg = load_config(_config(tmp_path, model_dir))
    warm = compile_warmup.start_compile_warmup(cfg, "cpu")
    _until(warm.compiling_path.exists, "the child to start compiling")
    with pytest.warns(UserWarning, match=r"compile warm-up \(rank 0, .*\) timeout: still compiling after 0.5 s"):
        result = warm.wait(timeout_s=0.5)
    assert result["status"] == "timeout" and warm.proc.returncode is not None
    with pytest.raises(ProcessLookupError):  # its process group is gone
        os.killpg(warm.proc.pid, 0)


def test_a_child_still_importing_when_the_learner_compiles_is_killed_not_waited_for(tmp_path, model_dir, capsys):
    cfg = load_config(_config(tmp_path, model_dir))
    warm = compile_warmup.start_compile_warmup(cfg, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # expected, not a failure: no warning
        result = compile_warmup.wait_for_warmup()  # at once: the child is still importing torch
    assert result["status"] == "overtaken" and warm.proc.returncode is not None
    assert warm.waited_s < 30 and not warm.compiling_path.exists()
    assert "overtaken: the learner's first compile came before the child's" in capsys.readouterr().out


def test_the_key_resolves_only_where_the_learner_compiles(tmp_path, model_dir):
    assert compile_warmup_enabled(TrainConfig(), "cuda")  # the LM head and the layers compile on a GPU
    assert not compile_warmup_enabled(TrainConfig(), "cpu")  # nothing compiles on a CPU by default
    assert not compile_warmup_enabled(TrainConfig(compile_layers=True), "cpu")  # auto: on a GPU only
    assert compile_warmup_enabled(TrainConfig(compile_layers=True, compile_warmup=True), "cpu")
    assert not compile_warmup_enabled(TrainConfig(compile_warmup=False), "cuda")
    assert not compile_warmup_enabled(TrainConfig(compile_layers=False, compile_head=False), "cuda")
    cfg = load_config(_config(tmp_path, model_dir, compile_warmup="auto"))
    assert compile_warmup.start_compile_warmup(cfg, "cpu") is None
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"train.compile_warmup=true .* compiles nothing on cpu"):
            validate_config(load_config(_config(tmp_path, model_dir, compile_layers="auto")), 1, check_paths=False)
    path = _config(tmp_path, model_dir, compile_warmup=False)
    text = yaml.safe_load(path.read_text())
    del text["train"]["compile_layers"]  # DeepSpeed refuses that key first
    path.write_text(yaml.safe_dump(text))
    with pytest.raises(ConfigError, match="train.compile_warmup is set but train.strategy='deepspeed'"):
        validate_config(load_config(path, ["train.strategy=deepspeed"]), 1, check_paths=False)


def test_the_child_batch_fills_one_microbatch_like_the_runs_with_two_rows_at_least(tmp_path, model_dir):
    def shape(budget, new, max_prompt=512):
        cfg = load_config(_config(tmp_path, model_dir, micro_batch_tokens=budget),
                          [f"engine.max_new_tokens={new}", f"data.max_prompt_tokens={max_prompt}"])
        return compile_warmup.warmup_batch_shape(cfg)

    assert shape(8 * 768, 512) == (256, 512, 8)  # the GPU benchmark's microbatch: 8 rows of 256 + 512 tokens
    assert shape(64, 6) == (26, 6, 2)  # two rows where the budget holds only two
    assert shape(64, 600) == (1, 31, 2)  # a response longer than half the budget is cut to fit two rows
    assert shape(30, 1, max_prompt=8) == (4, 1, 6)  # 6 rows of 5 tokens
    assert shape(36, 1, max_prompt=10) == (5, 1, 5)  # 6 rows of 6 tokens would share one symbol: 5 rows


def test_the_learners_first_compile_waits_for_the_child(tmp_path, model_dir):
    from streamrft.learner.compiling import CompiledOrEager

    cfg = load_config(_config(tmp_path, model_dir))
    cfg.model.path = str(tmp_path / "no-such-model")  # a child that fails at once: the wait reports it
    warm = compile_warmup.start_compile_warmup(cfg, "cpu")
    warm.proc.wait(timeout=300)
    double = CompiledOrEager(lambda x: x * 2, "test.compile", "doubling", backend="eager")
    with pytest.warns(UserWarning, match=r"compile warm-up \(rank 0, .*\) failed"):
        assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0))
    assert warm.result["status"] == "failed" and warm.proc.returncode is not None


def test_streamrft_train_starts_the_child_first_and_kills_it_when_the_run_ends(tmp_path, model_dir, monkeypatch):
    from streamrft import compose

    cfg = load_config(_config(tmp_path, model_dir))
    cfg.train.max_steps = -1  # refused by the config check, which runs after the child started
    started = []
    real_start = compile_warmup.start_compile_warmup
    monkeypatch.setattr(compile_warmup, "start_compile_warmup", lambda c: started.append(real_start(c, "cpu")))
    with pytest.raises(ConfigError, match="train.max_steps=-1"):
        compose.train(cfg)
    assert started and started[0] is not None
    assert started[0].proc.returncode is not None  # killed (or ended) with the run
    assert compile_warmup.active_warmup() is None


def test_the_children_of_a_machine_share_its_compile_workers():
    assert compile_warmup.compile_threads_per_child(16, 1) == 16  # one rank: Inductor's own default
    assert compile_warmup.compile_threads_per_child(128, 8) == 4  # the default caps at 32 workers, split 8 ways
    assert compile_warmup.compile_threads_per_child(16, 8) == 2
    assert compile_warmup.compile_threads_per_child(4, 8) == 1


# `streamrft train` in a fresh interpreter, its config refused by the check: what was imported when the child
# started, the exit code, and whether the child is gone
CLI_RUN = """
import json, sys
from streamrft.learner import compile_warmup
seen, children = [], []
real_start = compile_warmup.start_compile_warmup
def start(cfg, device_type=None):
    seen.append(sorted(m for m in ("torch", "transformers") if m in sys.modules))
    children.append(real_start(cfg, "cpu"))
    return children[-1]
compile_warmup.start_compile_warmup = start
from streamrft import cli
code = cli.main(["train", sys.argv[1], "train.max_steps=-1"])
print(json.dumps({"imported_at_start": seen, "code": code, "child_ended": children[0].proc.poll() is not None,
                  "active": compile_warmup.active_warmup() is not None}))
"""


def test_streamrft_train_starts_the_child_before_importing_torch_and_kills_it_when_the_check_fails(
        tmp_path, model_dir):
    """The child's head start is the run's own imports (torch, transformers, the learner: ~10 s on the H200 host),
    so `streamrft train` starts it right after reading the config; a config the check refuses ends it."""
    path = _config(tmp_path, model_dir)
    out = subprocess.run([sys.executable, "-c", CLI_RUN, str(path)], capture_output=True, text=True, timeout=300,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"imported_at_start": [[]], "code": 2, "child_ended": True, "active": False}
    assert "train.max_steps=-1" in out.stderr


def test_the_device_probe_imports_no_torch_and_a_child_whose_torch_finds_no_gpu_skips(tmp_path, model_dir,
                                                                                     monkeypatch):
    probe = ("import sys; from streamrft.learner.compile_warmup import probe_device_type as p; "
             "print(p(), 'torch' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    hidden = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO,
                            env={**env, "CUDA_VISIBLE_DEVICES": "-1"})
    assert hidden.stdout.split() == ["cpu", "False"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert compile_warmup.probe_device_type() == "cpu"  # torch imported here: it decides, and sees no device
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the child would not skip")
    cfg = load_config(_config(tmp_path, model_dir))
    result = compile_warmup.warm(cfg, "cuda", tmp_path / "marker")
    assert result["status"] == "skipped" and "finds no CUDA device" in result["reason"]
    assert not (tmp_path / "marker").exists()  # never reached the compile: the learner does not wait for it
    # the real child, told "cuda": it begins the CUDA context first (streamrft/cuda_preinit.py), and says how that went
    config_path, result_path = tmp_path / "child.config.json", tmp_path / "child.json"
    config_path.write_bytes(msgspec.json.encode(cfg))
    child = subprocess.run([sys.executable, "-m", "streamrft.learner.compile_warmup", str(config_path),
                            str(result_path), "cuda"], capture_output=True, text=True, timeout=300, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(result_path.read_text())
    assert result["status"] == "skipped" and result["cuda_preinit_s"] is not None
    # no driver library here, or one without a device (a GPU machine skipped above)
    assert result["cuda_preinit"].startswith(("no CUDA driver: ", "cuInit returned CUresult ")), result


WORKERS = """
import json, os, sys, time
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "2"
from streamrft.learner.compile_warmup import CompileWorkers
workers = CompileWorkers(force=sys.argv[1] == "force")
if workers.status == "started":
    from torch._inductor.async_compile import AsyncCompile
    AsyncCompile.wait_pool_ready(timeout=120)
    deadline = time.monotonic() + 30
    while workers.ready_s is None and time.monotonic() < deadline:  # the callback runs just after the answer
        time.sleep(0.01)
print(json.dumps(workers.report()))
"""


@pytest.mark.parametrize("how", ["force", "as_inductor", "switched_off", "left_to_inductor"])
def test_the_child_starts_inductors_compile_workers_first_and_reports_when_they_are_ready(how):
    """Inductor starts its compile workers at the first compile, and compiles Triton kernels in the calling process
    until they are ready (seconds: they import torch); the child starts them before anything else. A real pool
    here (``force``: this CPU's torch would not start one without Triton)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if how == "switched_off":
        env["TORCH_WARM_POOL"] = "0"  # Inductor's own switch: the child honours it
    if how == "left_to_inductor":  # the A/B's other arm: Inductor starts them at the first compile, as it would
        env["STREAMRFT_COMPILE_WORKERS_FIRST"] = "0"
    out = subprocess.run([sys.executable, "-c", WORKERS, how], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    if how == "switched_off":
        assert report == {"compile_pool": "not started: TORCH_WARM_POOL is not 1", "compile_pool_started_s": None,
                          "compile_pool_ready_s": None}
    elif how == "left_to_inductor":  # before the Triton check: the same report on a GPU machine
        assert report == {"compile_pool": "left to Inductor (STREAMRFT_COMPILE_WORKERS_FIRST=0): started at the "
                          "first compile", "compile_pool_started_s": None, "compile_pool_ready_s": None}
    elif how == "force" or importlib.util.find_spec("triton") is not None:
        assert report["compile_pool"] == "started", report
        assert 0 < report["compile_pool_started_s"] < report["compile_pool_ready_s"], report
    else:
        assert report == {"compile_pool": "not used: no Triton (CPU kernels compile in a thread pool)",
                          "compile_pool_started_s": None, "compile_pool_ready_s": None}


def _warmup_children(output_dir: Path) -> list[int]:
    """The live processes whose command line names a file of this run's compile_warmup folder."""
    return live_processes(str(output_dir / "compile_warmup"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_a_run_stopped_during_start_up_leaves_no_warm_up_child(tmp_path, model_dir, sig):
    """The child runs in a session of its own, so only the run ends it. SIGTERM or Ctrl-C during the start-up (the
    checks, the imports, the model load: the loop's handlers do not exist yet) ends the run saying so, exit 130, and
    the run stops its child; SIGKILL, where the run cleans up nothing, takes the child with it too (PR_SET_PDEATHSIG).
    (SIGTERM used to end the run without a word, its child left compiling.)"""
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{i}+1=", "reference": str(i + 1)}) + "\n" for i in range(8)))
    path = _config(tmp_path, model_dir)
    cfg = yaml.safe_load(path.read_text())
    cfg.update(data={"train_path": str(train)}, train={**cfg["train"], "max_steps": 1})
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "streamrft.cli", "train", str(path)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        _until(lambda: _warmup_children(tmp_path / "run") or proc.poll() is not None, "the warm-up child", 120)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(sig)  # the run has just started its child: it is importing torch for the config checks
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _until(lambda: not _warmup_children(tmp_path / "run"), "the warm-up child to end", 30)
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        return
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"streamrft: stopped by {sig.name} on rank 0 during start-up, before the "
                                            "first step; nothing trained, no checkpoint written"), err[-3000:]
    assert "Traceback" not in err and not (tmp_path / "run" / "checkpoints").exists()
