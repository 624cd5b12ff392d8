"""validate_reward: every unusable reward section is a ConfigError naming the key and the fix."""

from __future__ import annotations

import msgspec
import pytest

from streamrft.config import Config
from streamrft.config.base import ConfigError
from streamrft.rewards.validate import validate_reward


def cfg_with(*sources: dict, **reward) -> Config:
    return msgspec.convert({"reward": {"sources": list(sources), **reward}}, Config)


def test_a_valid_section_passes(tmp_path):
    path = tmp_path / "f.py"
    path.write_text("def f(r, ref):\n    return 1.0\n")
    validate_reward(cfg_with(
        {"name": "correct", "type": "rule", "fn": "gsm8k", "labels": ["gsm8k"], "label_weights": {"gsm8k": 2.0}},
        {"name": "mine", "type": "custom", "fn": f"{path}:f"},
        {"name": "rm", "type": "remote", "address": "tcp://127.0.0.1:5555"},
        {"name": "rm2", "type": "remote", "address": "http://127.0.0.1:8000/get_reward"},
    ))


@pytest.mark.parametrize(
    "source, message",
    [
        ({"name": "c", "type": "rule", "fn": "gsm9k"}, "not a rule; valid rules: arith, boxed_format, gsm8k, math"),
        ({"name": "c", "type": "custom", "fn": "justaname"}, "is not 'module:function'"),
        ({"name": "c", "type": "custom", "fn": "/no/such/file.py:f"}, "does not exist"),
        ({"name": "c", "type": "remote"}, r"reward.sources\[0\] \('c'\).address is empty"),
        ({"name": "c", "type": "remote", "address": "localhost:5555"}, "must be tcp://host:port"),
        ({"name": "c", "type": "rule", "fn": "arith", "weight": float("nan")}, "weight=nan must be a finite"),
        ({"name": "c", "type": "rule", "fn": "arith", "labels": ["a"], "label_weights": {"b": 1.0}},
         "names label 'b', which is not in its labels"),
        ({"name": "c", "type": "model"}, r"model_path is empty; set it to a directory written by `streamrft train-rm`"),
        ({"name": "", "type": "rule", "fn": "arith"}, "name='' must be a non-empty name"),
    ],
)
def test_each_bad_source_is_named_with_the_fix(source, message):
    with pytest.raises(ConfigError, match=message):
        validate_reward(cfg_with(source))


def test_a_model_source_without_rm_json_fails_the_path_checks_only(tmp_path):
    from streamrft.rewards.validate import validate_reward_paths

    cfg = cfg_with({"name": "c", "type": "model", "model_path": str(tmp_path)})
    validate_reward(cfg)  # shape only: the directory may be produced later (check_paths=False)
    with pytest.raises(ConfigError, match=r"model_path=.* is not a trained reward model \(no rm.json\)"):
        validate_reward_paths(cfg)


def test_duplicate_source_names_are_rejected():
    src = {"name": "c", "type": "rule", "fn": "arith"}
    with pytest.raises(ConfigError, match="name is used twice"):
        validate_reward(cfg_with(src, src))


def test_empty_sources_fail_unless_the_run_is_pure_distillation():
    with pytest.raises(ConfigError, match="reward.sources is empty"):
        validate_reward(Config())
    validate_reward(msgspec.convert({"teacher": {"type": "streamrft", "mode": "pure", "address": "tcp://h:1"}}, Config))


@pytest.mark.parametrize("key, value, message", [
    ("timeout_s", 0, "reward.timeout_s=0"),
    ("max_concurrency", 0, "reward.max_concurrency=0"),
    ("retries", -1, "reward.retries=-1"),
])
def test_bad_reward_limits_are_named(key, value, message):
    with pytest.raises(ConfigError, match=message):
        validate_reward(cfg_with({"name": "c", "type": "rule", "fn": "arith"}, **{key: value}))
