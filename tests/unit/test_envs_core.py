"""Environment registry and env.* config validation (issue 18): errors before any model is loaded."""

from __future__ import annotations

import asyncio

import pytest

from streamrft.config import ConfigError, load_config, validate_config
from streamrft.envs import EnvSpecError, EnvStep, load_environment, registered_environments

BASE = ["reward.sources=[{name: c, type: rule, fn: gsm8k}]"]


class NeedsLimit:
    def __init__(self, limit: int) -> None:
        self.limit = limit

    async def reset(self, row):
        return None

    async def step(self, action):
        return EnvStep(observation=None, done=True)

    async def close(self):
        return None


class SyncStep(NeedsLimit):
    def step(self, action):  # not async: refused when an episode's instance is made
        return EnvStep(observation=None, done=True)


def _check(*overrides: str) -> None:
    validate_config(load_config(None, [*BASE, *overrides]), check_paths=False)


def test_builtins_are_registered_and_scripted_answers_its_script_then_ends():
    assert {"scripted", "echo", "tools"} <= set(registered_environments())
    env = load_environment("scripted", observations=["a", "b"], rewards=[0.5, 0.0, 2.0], role="user")()
    steps = [asyncio.run(env.step(f"t{i}")) for i in range(3)]
    assert [(s.observation, s.reward, s.done, s.role) for s in steps] == [
        ("a", 0.5, False, "user"), ("b", 0.0, False, "user"), (None, 2.0, True, "user")]
    echo = load_environment("echo", turns=2)()
    assert asyncio.run(echo.step(" hi ")).observation == "You said: hi"
    assert asyncio.run(echo.step("x")).done


def test_module_class_and_file_specs_load_and_their_kwargs_are_checked(tmp_path):
    assert isinstance(load_environment(f"{__name__}:NeedsLimit", limit=3)(), NeedsLimit)
    f = tmp_path / "myenv.py"
    f.write_text("class E:\n    async def reset(self, row): return None\n    async def step(self, a): return None\n"
                 "    async def close(self): return None\n")
    assert type(load_environment(f"{f}:E")()).__name__ == "E"
    with pytest.raises(EnvSpecError, match=r"needs argument\(s\) \['limit'\]"):
        load_environment(f"{__name__}:NeedsLimit")
    with pytest.raises(EnvSpecError, match=r"takes no argument\(s\) \['limt'\] \(it takes \['limit'\]\)"):
        load_environment(f"{__name__}:NeedsLimit", limt=3)
    with pytest.raises(EnvSpecError, match=r"SyncStep.step must be an async method"):
        load_environment(f"{__name__}:SyncStep", limit=1)()
    with pytest.raises(EnvSpecError, match=r"module 'no_such_pkg' not found"):
        load_environment("no_such_pkg:Env")


@pytest.mark.parametrize("overrides, message", [
    (["env.name=nope"], "env.name 'nope' is neither a registered environment (echo, scripted, tools)"),
    (["env.name=scripted", "env.max_turns=0"], "env.max_turns=0 must be >= 1"),
    (["env.name=scripted", "env.max_tokens=3"], "env.max_tokens=3 is below engine.max_new_tokens="),
    (["env.max_turns=3"], "env.max_turns=3 is set but env.name is empty"),
    (["env.kwargs={a: 1}"], "env.kwargs is set but env.name is empty"),
    (["env.name=scripted", "env.kwargs={foo: 1}"], "env.kwargs: environment 'scripted' takes no argument(s) ['foo']"),
    (["env.name=scripted", "env.kwargs={observations: [a], rewards: [1]}"],
     "env.kwargs.rewards for 'scripted' has 1 value(s); expected one per model turn (2 = len(observations) + 1)"),
    (["env.name=scripted", "data.chat_template=none"], "renders observations with the chat template, but data.chat_template=none"),
    (["env.name=scripted", "engine.type=vllm"], "needs engine.type=hf"),
])
def test_env_settings_that_cannot_run_are_refused_before_any_model(overrides, message):
    with pytest.raises(ConfigError) as info:
        _check(*overrides)
    assert message in str(info.value)


def test_a_model_whose_template_cannot_render_observations_is_refused_from_its_tokenizer_files(tmp_path):
    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2

    tok = build_char_tokenizer(str(tmp_path), "0123456789")  # no chat template
    build_tiny_qwen2(str(tmp_path), tok, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=8)
    cfg = load_config(None, [*BASE, f"model.path={tmp_path}", "env.name=scripted"])
    from streamrft.config.env import validate_env

    with pytest.raises(ConfigError, match="env.name needs a chat template to render observations, but the tokenizer .* has none"):
        validate_env(cfg, check_paths=True)
    _check("env.name=scripted", "env.kwargs={observations: [a], role: user}")  # valid without paths


def test_the_roles_an_environment_answers_with_are_checked_against_the_chat_template(tmp_path):
    from streamrft.config.env import validate_env
    from streamrft.models.tiny import build_char_tokenizer, build_tiny_qwen2

    tok = build_char_tokenizer(str(tmp_path), "0123456789", chat=True)  # its template knows system/user/assistant
    build_tiny_qwen2(str(tmp_path), tok, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=8)
    ok = load_config(None, [*BASE, f"model.path={tmp_path}", "env.name=scripted", "env.kwargs={role: user}"])
    validate_env(ok, check_paths=True)
    for env in ("env.kwargs={role: tool}", "env.name=tools"):
        cfg = load_config(None, [*BASE, f"model.path={tmp_path}", "env.name=scripted", env])
        with pytest.raises(ConfigError, match=r"observation with role 'tool': the chat template cannot render "
                                               r"message role\(s\) \['tool'\]"):
            validate_env(cfg, check_paths=True)
