"""Config loading: unknown keys, wrong types and incompatible settings fail before anything starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from streamrft.config import ConfigError, load_config, validate_config

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_overrides_set_dotted_keys_with_typed_values(tmp_path):
    cfg = load_config(write(tmp_path, "train:\n  max_steps: 5\n"), ["train.max_steps=7", "train.lr=0.5", "engine.stop_token_ids=[1, 2]"])
    assert cfg.train.max_steps == 7
    assert cfg.train.lr == 0.5
    assert cfg.engine.stop_token_ids == [1, 2]


def test_unknown_key_is_an_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown field `max_step`.*train"):
        load_config(write(tmp_path, "train:\n  max_step: 5\n"))


def test_unknown_override_key_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown field `learning_rate`"):
        load_config(None, ["train.learning_rate=1"])


def test_a_bad_override_is_blamed_on_the_overrides_not_on_a_valid_file(tmp_path):
    path = write(tmp_path, "train:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match=r"^the overrides \(train.lr=0.1 nosuch.key=1\): .*unknown field `nosuch`"):
        load_config(path, ["train.lr=0.1", "nosuch.key=1"])
    bad = write(tmp_path, "train:\n  max_steps: many\n")
    with pytest.raises(ConfigError, match=r"c.yaml: Expected `int`, got `str` - at `train.max_steps`"):
        load_config(bad, ["train.lr=0.1"])  # the file is the culprit: it is named


def test_wrong_type_is_an_error_naming_the_path(tmp_path):
    with pytest.raises(ConfigError, match=r"Expected `int`, got `str` - at `train.max_steps`"):
        load_config(write(tmp_path, "train:\n  max_steps: many\n"))


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_malformed_yaml_names_the_file(tmp_path):
    path = write(tmp_path, "train: [unclosed\n")
    with pytest.raises(ConfigError, match=str(path)):
        load_config(path)


def test_override_without_equals_sign_is_an_error():
    with pytest.raises(ConfigError, match="is not key=value"):
        load_config(None, ["train.max_steps"])


def rule_reward() -> list[str]:
    return ["reward.sources=[{name: exact, type: rule, fn: arith}]"]


def test_group_norm_with_one_sample_per_prompt_is_rejected():
    cfg = load_config(None, ["rollout.n_samples_per_prompt=1", *rule_reward()])
    with pytest.raises(ConfigError, match="n_samples_per_prompt >= 2"):
        validate_config(cfg, world_size=1, check_paths=False)


def test_train_batch_not_divisible_by_world_size_is_rejected():
    cfg = load_config(None, ["rollout.prompts_per_step=6", *rule_reward()])
    with pytest.raises(ConfigError, match="prompts_per_step=6 is not divisible by world_size=4"):
        validate_config(cfg, world_size=4, check_paths=False)
    validate_config(cfg, world_size=2, check_paths=False)


@pytest.mark.parametrize("override, message", [
    ("train.log_every=0", "train.log_every=0 must be >= 1"),  # was a ZeroDivisionError at the first step's log
    ("data.eval_size=-1", "data.eval_size=-1 must be >= 0"),  # was rows[:-1]: the last held-out row dropped
    ("data.max_prompt_tokens=0", "data.max_prompt_tokens=0 must be >= 1"),
    ("train.weight_decay=-0.1", "train.weight_decay=-0.1 must be >= 0.0"),
    ("train.adam_eps=0", "train.adam_eps=0.0 must be > 0.0"),
    ("train.grad_clip=-1", "train.grad_clip=-1.0 must be >= 0.0"),
    ("train.warmup_steps=-1", "train.warmup_steps=-1 must be >= 0"),
    ("train.eval_every=-2", "train.eval_every=-2 must be >= 0"),
    ("metrics.port=-1", "metrics.port=-1 must be >= 0"),
    ("metrics.port=70000", "metrics.port=70000 must be a TCP port"),
    ("metrics.progress_log_every_s=-1", "metrics.progress_log_every_s=-1.0 must be >= 0.0"),
    ("warmup.steps=-1", "warmup.steps=-1 must be >= 0"),
])
def test_numbers_out_of_range_are_refused_before_anything_loads(override, message):
    cfg = load_config(None, [override, *rule_reward()])
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(cfg, world_size=1, check_paths=False)


@pytest.mark.parametrize("override, message", [("warmup.lr=0", "warmup.lr=0.0 must be > 0.0"),
                                               ("warmup.batch_size=0", "warmup.batch_size=0 must be >= 1")])
def test_the_supervised_warmups_numbers_are_refused_when_it_runs(override, message):
    cfg = load_config(None, ["warmup.steps=5", override, *rule_reward()])
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(cfg, world_size=1, check_paths=False)


def test_missing_model_path_is_rejected_with_the_key(tmp_path):
    cfg = load_config(None, [f"model.path={tmp_path / 'nomodel'}", *rule_reward()])
    with pytest.raises(ConfigError, match=r"model.path=.*nomodel: no config.json"):
        validate_config(cfg, world_size=1)


def test_every_shipped_pipeline_config_loads_and_validates():
    """Training configs, reward-model configs (top-level ``kind``) and eval configs (``model_path``)
    each load through their own typed loader and validate."""
    import yaml

    from streamrft.evaluate.config import load_eval_config
    from streamrft.rm.config import load_rm_config, validate_rm_config

    configs = sorted((REPO / "pipelines").glob("*/*.yaml"))
    kinds = {"train": 0, "rm": 0, "eval": 0}
    for path in configs:
        top = yaml.safe_load(path.read_text()) or {}
        if "kind" in top:
            validate_rm_config(load_rm_config(path), check_paths=False)
            kinds["rm"] += 1
        elif "model_path" in top:
            cfg = load_eval_config(path)  # typed: unknown keys and wrong types fail here
            assert cfg.k <= cfg.n and "{prompt}" in cfg.prompt_template
            kinds["eval"] += 1
        else:
            validate_config(load_config(path), world_size=1, check_paths=False)
            kinds["train"] += 1
    assert kinds["train"] >= 5 and kinds["rm"] >= 2 and kinds["eval"] >= 1, kinds


def test_exponent_numbers_without_a_dot_are_numbers():
    cfg = load_config(None, ["train.lr=1e-3"])
    assert cfg.train.lr == 1e-3


def test_the_cli_reports_an_incompatible_setting_before_anything_starts(capsys):
    from streamrft.cli import main

    assert main(["train", str(REPO / "pipelines/arith/config.yaml"), "--dry-run", "rollout.n_samples_per_prompt=1"]) == 2
    assert "needs rollout.n_samples_per_prompt >= 2, got 1" in capsys.readouterr().err
