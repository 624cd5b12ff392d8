"""engine.kernel_warmup (streamrft/engines/kernel_warmup.py, started by learner/compile_warmup.start_compile_warmup):
the key resolves only where the static path runs Triton kernels on a GPU; `true` elsewhere is refused by the config
check; a real child is started at launch with the run's world size, and its result is reported once (skipped on
this CPU; a child that dies without a result warns with its log; one still compiling when the run ends is killed).
What the child launches is checked against the engine's own launches under Triton's interpreter
(test_triton_decode.py)."""

import subprocess
import sys
import time
import warnings

import pytest
import torch
import yaml

from streamrft.config import load_config, validate_config
from streamrft.config.base import ConfigError
from streamrft.config.engine import EngineConfig, kernel_warmup_enabled
from streamrft.engines.kernel_warmup import likeliest_chunk
from streamrft.learner import compile_warmup


def _config(tmp_path, model_dir, **engine) -> object:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "run"), "compile_cache_dir": str(tmp_path / "cache"),
        "model": {"path": model_dir},
        "engine": {"max_new_tokens": 6, "static_cache": True, "max_batch_size": 64, **engine},
        "rollout": {"n_samples_per_prompt": 4, "prompts_per_step": 8},
        "reward": {"sources": [{"name": "correct", "type": "rule", "fn": "gsm8k"}]},
        "train": {"compile_warmup": False}}))
    return path


@pytest.fixture(autouse=True)
def no_active_warmup():
    yield
    compile_warmup.stop_compile_warmup()


def test_the_key_resolves_only_where_the_static_path_runs_triton_kernels_on_a_gpu(tmp_path, model_dir):
    assert kernel_warmup_enabled(EngineConfig(static_cache=True), "cuda")
    assert kernel_warmup_enabled(EngineConfig(static_cache=True, decode_kernels="triton", kernel_warmup=True), "cuda")
    assert not kernel_warmup_enabled(EngineConfig(static_cache=True), "cpu")  # no Triton kernels on a CPU
    assert not kernel_warmup_enabled(EngineConfig(), "cuda")  # the eager path launches none
    assert not kernel_warmup_enabled(EngineConfig(static_cache=True, decode_kernels="torch"), "cuda")
    assert not kernel_warmup_enabled(EngineConfig(static_cache=True, kernel_warmup=False), "cuda")
    assert not kernel_warmup_enabled(EngineConfig(type="vllm", static_cache=True), "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"engine.kernel_warmup=true .* launches none .* device cpu"):
            validate_config(load_config(_config(tmp_path, model_dir, kernel_warmup=True)), 1, check_paths=False)
    with pytest.raises(ConfigError, match="engine.kernel_warmup is set but engine.static_cache"):
        validate_config(load_config(_config(tmp_path, model_dir, static_cache=False, kernel_warmup=False)), 1,
                        check_paths=False)


def test_the_first_warmed_chunk_is_a_ranks_share_of_the_step_at_most_a_chunk(tmp_path, model_dir):
    cfg = load_config(_config(tmp_path, model_dir))  # 8 prompts x 4 samples, chunks of 64
    assert likeliest_chunk(cfg, 1) == 32 and likeliest_chunk(cfg, 2) == 16
    cfg.engine.max_batch_size = 8
    assert likeliest_chunk(cfg, 1) == 8
    cfg.rollout.placement, cfg.rollout.engine_ranks, cfg.engine.max_batch_size = "async", 4, 64
    assert likeliest_chunk(cfg, 1) == 8  # an engine process's share


def test_a_real_child_starts_with_the_world_size_and_reports_once_when_the_run_ends(tmp_path, model_dir, monkeypatch,
                                                                                   capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the child would warm, not skip")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg = load_config(_config(tmp_path, model_dir))
    assert compile_warmup.start_compile_warmup(cfg, "cuda") is None  # the learner's is off (train.compile_warmup)
    child = compile_warmup.active_kernel_warmup()
    assert child is not None and child.proc.args[-2:] == ["cuda", "2"]
    assert child.proc.wait(timeout=300) == 0
    compile_warmup.stop_compile_warmup()
    assert child.result["status"] == "skipped" and "finds no CUDA device" in child.result["reason"]
    # told "cuda", it began its CUDA context first, beside its imports (streamrft/cuda_preinit.py): no driver here
    assert child.result["cuda_preinit"].startswith(("no CUDA driver: ", "cuInit returned CUresult ")), child.result
    assert child.result["cuda_preinit_s"] is not None
    assert capsys.readouterr().out.count("engine kernel warm-up") == 1
    assert compile_warmup.active_kernel_warmup() is None
    monkeypatch.setenv("LOCAL_RANK", "1")  # the node's cache is warmed once, from local rank 0
    compile_warmup.start_compile_warmup(cfg, "cuda")
    assert compile_warmup.active_kernel_warmup() is None


def _child(tmp_path, code: str) -> compile_warmup.KernelWarmup:
    log = tmp_path / "child.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return compile_warmup.KernelWarmup(proc, tmp_path / "child.json", log, rank=0)


def test_a_child_that_dies_without_a_result_warns_with_its_log_once(tmp_path):
    child = _child(tmp_path, "print('no GPU memory left'); raise SystemExit(3)")
    child.proc.wait(timeout=60)
    with pytest.warns(UserWarning, match=r"(?s)engine kernel warm-up .* failed: exited with code 3 without a "
                                         r"result.*no GPU memory left"):
        assert child.collect()["status"] == "failed"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert child.collect(stopping=True)["status"] == "failed"  # reported once, not again


def test_a_child_still_compiling_is_not_waited_for_and_is_killed_when_the_run_ends(tmp_path, capsys):
    child = _child(tmp_path, "import time; time.sleep(120)")
    t0 = time.monotonic()
    assert child.collect() is None  # the first rollout does not wait for it
    assert child.collect(stopping=True)["status"] == "stopped"
    assert child.proc.returncode is not None and time.monotonic() - t0 < 30
    assert "engine kernel warm-up" in capsys.readouterr().out


def test_the_one_layer_copy_is_built_on_the_asked_device_and_on_the_cpu_if_that_fails(model_dir, monkeypatch,
                                                                                    capsys):
    """Both warm-up children build their copy on their GPU (its random init on a CPU took 4.2 s at 0.5B, 14.7 s at
    7B); "meta" stands in for a GPU here. A device that refuses the build costs a line in the child's log, and the
    copy is built on the CPU."""
    import transformers

    from streamrft.config.model import ModelConfig

    model_cfg = ModelConfig(path=model_dir, dtype="bfloat16")
    copy = compile_warmup.one_layer_model(model_cfg, torch.device("meta"))
    assert len(copy.model.layers) == 1 and {p.device.type for p in copy.parameters()} == {"meta"}
    assert next(copy.parameters()).dtype == torch.bfloat16
    real = transformers.AutoModelForCausalLM.from_config

    def refuse_meta(*args, **kwargs):
        if torch.get_default_device().type == "meta":
            raise RuntimeError("no room on the device")
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refuse_meta)
    copy = compile_warmup.one_layer_model(model_cfg, "meta")
    assert {p.device.type for p in copy.parameters()} == {"cpu"}
    logged = capsys.readouterr().out
    assert "building on meta failed (RuntimeError: no room on the device); building on the CPU" in logged
