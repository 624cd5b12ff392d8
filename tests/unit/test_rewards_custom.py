"""Custom reward functions: spec loading (module and file forms), sync/async/batched calling, errors."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from protocols import RewardItem
from streamrft.rewards import RewardFunction, batched, load_reward_function
from streamrft.rewards.custom import BatchRewardError

MODULE = textwrap.dedent(
    """
    import asyncio
    import streamrft.rewards

    def exact(response, reference):
        return float(response == reference)

    def with_context(response, reference, prompt="", label=""):
        return float(len(prompt)) + (100.0 if label == "special" else 0.0)

    def with_kwargs(response, reference, **kwargs):
        return float(len(kwargs["prompt"]))

    async def slow_exact(response, reference):
        await asyncio.sleep(0.01)
        return response == reference

    def raises_on_bad(response, reference):
        if response == "bad":
            raise RuntimeError("cannot score 'bad'")
        return 1.0

    @streamrft.rewards.batched
    def lengths(responses, references, prompts=None):
        return [len(r) + len(p) for r, p in zip(responses, prompts)]

    async def async_batch(responses, references):
        return [1.0] * len(responses)
    async_batch.batched = True

    @streamrft.rewards.batched
    def short_batch(responses, references):
        return [1.0]

    NOT_CALLABLE = 3
    """
)


def items(*pairs, prompt="pp", label="default"):
    return [RewardItem(sample_id=str(i), prompt=prompt, response=r, reference=ref, label=label)
            for i, (r, ref) in enumerate(pairs)]


@pytest.fixture
def module_name(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards_mod"


def score(spec: str, batch):
    return asyncio.run(RewardFunction(load_reward_function(spec), spec).score(batch))


def test_a_sync_per_sample_function_loads_from_module_colon_function(module_name):
    assert score(f"{module_name}:exact", items(("a", "a"), ("a", "b"))) == [1.0, 0.0]


def test_a_function_loads_from_a_file_path(tmp_path):
    path = tmp_path / "sub" / "reward_file.py"
    path.parent.mkdir()
    path.write_text(MODULE)
    assert score(f"{path}:exact", items(("x", "x"))) == [1.0]


def test_prompt_and_label_are_passed_only_to_functions_that_accept_them(module_name):
    assert score(f"{module_name}:with_context", items(("r", "r"), prompt="abc", label="special")) == [103.0]
    assert score(f"{module_name}:with_kwargs", items(("r", "r"), prompt="abcd")) == [4.0]


def test_an_async_function_is_awaited_and_bools_count_as_numbers(module_name):
    assert score(f"{module_name}:slow_exact", items(("a", "a"), ("a", "b"))) == [1.0, 0.0]


def test_a_per_sample_exception_fails_only_that_sample(module_name):
    out = score(f"{module_name}:raises_on_bad", items(("ok", ""), ("bad", "")))
    assert out[0] == 1.0
    assert isinstance(out[1], RuntimeError) and "'bad'" in str(out[1])


def test_a_batched_function_is_called_once_with_lists(module_name):
    fn = RewardFunction(load_reward_function(f"{module_name}:lengths"), "lengths")
    assert fn.is_batched
    assert asyncio.run(fn.score(items(("abc", ""), ("a", ""), prompt="p"))) == [4.0, 2.0]


def test_the_batched_attribute_works_without_the_decorator_on_an_async_function(module_name):
    fn = RewardFunction(load_reward_function(f"{module_name}:async_batch"), "async_batch")
    assert fn.is_batched and fn.is_async
    assert asyncio.run(fn.score(items(("a", ""), ("b", "")))) == [1.0, 1.0]


def test_a_batched_function_returning_the_wrong_length_fails_the_whole_batch(module_name):
    out = score(f"{module_name}:short_batch", items(("a", ""), ("b", "")))
    assert all(isinstance(v, BatchRewardError) for v in out)
    assert "returned 1 values for 2 samples" in str(out[0])


def test_the_batched_decorator_marks_the_function():
    @batched
    def f(responses, references):
        return []

    assert f.batched is True


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_colon_here", "is not 'module:function'"),
        ("no_such_module_xyz:fn", "module 'no_such_module_xyz' not found"),
        ("/nonexistent/dir/r.py:fn", "does not exist"),
        ("mod:not-an-identifier", "is not 'module:function'"),
    ],
)
def test_bad_specs_raise_value_errors_naming_the_spec(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        load_reward_function(spec)
    assert repr(spec) in str(info.value)


def test_a_missing_or_non_callable_attribute_is_named(module_name):
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_reward_function(f"{module_name}:nope")
    with pytest.raises(ValueError, match="not a function"):
        load_reward_function(f"{module_name}:NOT_CALLABLE")


def test_a_non_numeric_return_is_a_per_sample_error(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def f(response, reference):\n    return 'high'\n")
    out = score(f"{path}:f", items(("a", "")))
    assert isinstance(out[0], TypeError) and "'high'" in str(out[0])
