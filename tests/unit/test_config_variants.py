"""Issue 16 item 4: every setting checked at --dry-run and before any model load. Settings of a variant
that is not selected are errors (config/variants.py); engine settings no engine can run, a custom
reward function missing from its file and an in-process engine without its package fail validation."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from streamrft.config import Config, ConfigError, load_config, validate_config
from streamrft.config.algorithm import AlgorithmConfig
from streamrft.config.reward import RewardSourceConfig
from streamrft.config.variants import SET, VARIANT_KEYS, validate_variants, written_keys

REPO = Path(__file__).resolve().parents[2]
ARITH = str(REPO / "pipelines" / "arith" / "config.yaml")


def settings(*overrides: str) -> Config:
    return load_config(ARITH, list(overrides))


@pytest.mark.parametrize("override, message", [
    ("engine.tensor_parallel_size=1", "engine.tensor_parallel_size is set but engine.type='hf'; it applies only "
                                      "to engine.type in ('vllm',)"),
    ("engine.gpu_memory_utilization=0.5", "engine.gpu_memory_utilization is set but engine.type='hf'; it applies "
                                          "only to engine.type in ('vllm',)"),
    ("engine.enforce_eager=false", "engine.enforce_eager is set but engine.type='hf'"),
    ("engine.weight_sync=tensor", "engine.weight_sync is set but engine.type='hf'; it applies only to "
                                  "engine.type in ('sglang',)"),
    # a key two levels down names the outermost variant that is not selected
    ("engine.weight_group_backend=gloo", "engine.weight_group_backend is set but engine.type='hf'; it applies "
                                         "only to engine.type in ('sglang',)"),
    ("algorithm.lam=0.95", "algorithm.lam is set but algorithm.advantage_estimator='group_norm'; it applies only "
                           "to algorithm.advantage_estimator in ('gae',)"),
    ("algorithm.gamma=0.99", "algorithm.gamma is set but algorithm.advantage_estimator='group_norm'; it applies "
                             "only to algorithm.advantage_estimator in ('reinforce', 'reinforce_baseline', "
                             "'reinforce++', 'gae')"),
    ("teacher.weight=0.5", "teacher.weight is set but teacher.type='none'; it applies only to teacher.type in "
                           "('streamrft', 'sglang', 'vllm')"),
    ("teacher.mode=hybrid", "teacher.mode is set but teacher.type='none'"),
    ("algorithm.kl_estimator=k1", "algorithm.kl_estimator is set but algorithm.kl_coef=0.0; it applies only when "
                                  "algorithm.kl_coef is set; remove algorithm.kl_estimator or set algorithm.kl_coef"),
    ("train.zero_stage=2", "train.zero_stage is set but train.strategy='fsdp2'; it applies only to "
                           "train.strategy in ('deepspeed',)"),
    (("train.strategy=deepspeed", "train.compile_layers=true"),
     "train.compile_layers is set but train.strategy='deepspeed'; it applies only to train.strategy in ('fsdp2',)"),
    (("train.strategy=deepspeed", "train.optimizer_offload=true"),
     "train.optimizer_offload is set but train.strategy='deepspeed'; it applies only to train.strategy in ('fsdp2',)"),
    (("train.optimizer_offload=true", "train.fused_adamw=true"),
     "train.fused_adamw is set but train.optimizer_offload=True; it applies only to train.optimizer_offload in "
     "(False,)"),
    (("train.compile_layers=false", "train.activation_memory_budget=0.5"),
     "train.activation_memory_budget is set but train.compile_layers=False; it applies only to "
     "train.compile_layers in ('auto', True)"),
    ("model.lora_alpha=32", "model.lora_alpha is set but model.lora_rank=0; it applies only when model.lora_rank is set"),
    ("reward.sources=[{name: a, type: rule, fn: arith, address: 'tcp://127.0.0.1:5555'}]",
     "reward.sources[0].address is set but reward.sources[0].type='rule'; it applies only to "
     "reward.sources[0].type in ('remote',)"),
])
def test_item4_a_key_of_an_unselected_variant_is_an_error(override, message):
    with pytest.raises(ConfigError) as info:
        validate_config(settings(*([override] if isinstance(override, str) else override)), world_size=1,
                        check_paths=False)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("overrides", [
    ("algorithm.advantage_estimator=gae", "model.critic_path=x", "algorithm.lam=0.95", "algorithm.gamma=0.99"),
    ("algorithm.advantage_estimator=reinforce", "algorithm.gamma=0.99"),
    ("teacher.type=streamrft", "teacher.address=tcp://127.0.0.1:1", "teacher.mode=hybrid", "teacher.weight=0.5"),
    ("algorithm.kl_coef=0.1", "algorithm.kl_estimator=k1", "algorithm.kl_ctl_type=adaptive", "algorithm.kl_target=3"),
    ("engine.type=vllm", "engine.tensor_parallel_size=1", "engine.max_model_len=64"),
    ("train.compile_layers=true", "train.activation_memory_budget=0.5"),
])
def test_item4_keys_of_the_selected_variant_are_accepted(overrides):
    validate_config(settings(*overrides), world_size=1, check_paths=False)


def test_item4_a_default_value_written_explicitly_still_counts_as_set():
    cfg = settings("engine.tensor_parallel_size=1")  # 1 is the default: the user wrote it anyway
    assert "engine.tensor_parallel_size" in cfg._written
    with pytest.raises(ConfigError, match="engine.tensor_parallel_size is set but engine.type='hf'"):
        validate_variants(cfg, cfg._written)
    validate_variants(cfg, None)  # by value (a Config built in code) it equals the default: not set


def test_item4_a_config_built_in_code_is_checked_by_values_that_differ_from_defaults():
    cfg = Config(algorithm=AlgorithmConfig(lam=0.9), reward=_rule_sources())
    with pytest.raises(ConfigError, match="^algorithm.lam is set but algorithm.advantage_estimator='group_norm'"):
        validate_config(cfg, world_size=1, check_paths=False)
    src = RewardSourceConfig(name="r", type="remote", address="tcp://127.0.0.1:9", fn="x:y")
    with pytest.raises(ConfigError, match=r"^reward.sources\[0\].fn is set but reward.sources\[0\].type='remote'"):
        validate_variants(Config(reward=msgspec.structs.replace(Config().reward, sources=[src])), None)
    validate_config(Config(reward=_rule_sources()), world_size=1, check_paths=False)  # the defaults themselves pass


def _rule_sources():
    return msgspec.structs.replace(Config().reward, sources=[RewardSourceConfig(name="r", type="rule", fn="arith")])


def test_item4_written_keys_cover_nested_sections_and_list_items():
    data = {"engine": {"type": "hf", "top_k": 3}, "reward": {"sources": [{"name": "a", "fn": "arith"}]}, "seed": 1}
    assert written_keys(data) == {"engine.type", "engine.top_k", "reward.sources", "reward.sources[0].name",
                                  "reward.sources[0].fn", "seed"}


def test_item4_every_variant_row_names_real_keys_and_values():
    """The table cannot drift from the config: every key and owner is a field, every value a valid one."""
    cfg = Config(reward=_rule_sources())
    for key, (owner, values) in VARIANT_KEYS.items():
        for dotted in (key, owner):
            node = cfg
            for part in dotted.replace("[]", "[0]").split("."):
                name, _, index = part.partition("[")
                assert name in type(node).__struct_fields__, f"{dotted}: no field {name}"
                node = getattr(node, name)
                if index:
                    node = node[0]
        assert values == SET or (isinstance(values, tuple) and values), key


def test_item4_cuda_graphs_without_static_cache_and_a_bad_sleep_level_fail_the_dry_run(capsys):
    from streamrft.cli import main

    assert main(["train", ARITH, "--dry-run", "engine.cuda_graphs=true"]) == 2
    assert "engine.cuda_graphs=true needs engine.static_cache=true" in capsys.readouterr().err
    assert main(["train", ARITH, "--dry-run", "engine.sleep_level=7"]) == 2
    assert "engine.sleep_level=7 must be 1 (free the KV cache) or 2 (also release weights)" in capsys.readouterr().err


def test_item4_sglang_settings_are_checked_before_start():
    with pytest.raises(ConfigError, match="engine.type=sglang is a client of a running SGLang server"):
        validate_config(settings("engine.type=sglang"), world_size=1, check_paths=False)
    with pytest.raises(ConfigError, match="SGLang reports log-probs before top-k/top-p truncation"):
        validate_config(settings("engine.type=sglang", "engine.address=http://127.0.0.1:1", "engine.top_k=5"),
                        world_size=1, check_paths=False)


@pytest.fixture
def files(tmp_path, monkeypatch):
    """A model directory and a data file that pass the path checks (validation opens neither)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "1+1=", "reference": "2"}) + "\n")
    return ["model.path=model", "data.train_path=train.jsonl", "data.eval_path="]


def test_item4_a_custom_reward_function_missing_from_its_file_names_file_and_function(files, tmp_path):
    (tmp_path / "my_reward.py").write_text("def other(response, reference):\n    return 1.0\n")
    source = "reward.sources=[{name: mine, type: custom, fn: my_reward.py:score}]"
    with pytest.raises(ConfigError) as info:
        validate_config(settings(*files, source), world_size=1)
    assert str(info.value) == ("reward.sources[0] ('mine'): reward function spec 'my_reward.py:score': "
                               "my_reward.py has no attribute 'score'")
    ok = "reward.sources=[{name: mine, type: custom, fn: my_reward.py:other}]"
    validate_config(settings(*files, ok), world_size=1)


def test_item4_a_custom_reward_module_that_fails_to_import_is_an_error(files, tmp_path):
    (tmp_path / "broken_reward.py").write_text("raise RuntimeError('no GPU here')\n")
    source = "reward.sources=[{name: b, type: custom, fn: broken_reward.py:score}]"
    with pytest.raises(ConfigError, match=r"^reward.sources\[0\] \('b'\): importing broken_reward.py for "
                                          r"'broken_reward.py:score' failed: RuntimeError: no GPU here$"):
        validate_config(settings(*files, source), world_size=1)


def test_item4_vllm_in_process_without_the_package_says_how_to_install_it(files, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError) as info:
        validate_config(settings(*files, "engine.type=vllm"), world_size=1)
    assert str(info.value) == ("engine.type=vllm runs vLLM in this process, but the vllm package is not installed; "
                               "install the extra (pip install 'streamrft[vllm]', see docs/engines.md) or set "
                               "engine.address to a running vLLM server")
    validate_config(settings(*files, "engine.type=vllm", "engine.address=http://127.0.0.1:8000"), world_size=1)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="auto compiles the layers on a GPU")
def test_an_activation_memory_budget_where_auto_leaves_the_layers_eager_is_refused():
    # on this CPU-only machine train.compile_layers=auto runs the layers eagerly: the budget would do nothing
    with pytest.raises(ConfigError, match=r"train.activation_memory_budget=0.3 applies to the compiled decoder "
                                          r"layers, and train.compile_layers=auto compiles them on a GPU only"):
        validate_config(settings("train.activation_memory_budget=0.3"), world_size=1, check_paths=False)
    with pytest.raises(ConfigError, match=r"train.activation_memory_budget=-0.1 must be in \[0, 1\]"):
        validate_config(settings("train.compile_layers=true", "train.activation_memory_budget=-0.1"), world_size=1,
                        check_paths=False)
