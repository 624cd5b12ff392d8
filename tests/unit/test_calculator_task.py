"""The calculator demo's task pieces (pipelines/calculator): the warm-up traces are the token sequences the
runtime's episodes produce, the loss mask covers exactly the model's tokens, the reward reads only the answer."""

from __future__ import annotations

import asyncio

import pytest

from pipelines.calculator.task import (ANSWER_MARK, build_tokenizer, direct_trace, make_rows, render_ids, reward,
                                       tool_trace, trace_ids)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("calc_tok")
    build_tokenizer(str(out))
    return AutoTokenizer.from_pretrained(str(out))  # reloaded as the runtime loads it


def test_rows_are_disjoint_distinct_and_right():
    train, held = make_rows(300, 0, "train"), make_rows(100, 0, "eval")
    exprs = [r["prompt"][0]["content"] for r in train + held]
    assert len(set(exprs)) == 400
    for row in train + held:
        expr = row["prompt"][0]["content"]
        a, op, rest = expr.partition("*")
        want = int(a) * int(rest) if op else sum(int(x) for x in expr.split("+"))
        assert row["reference"] == str(want) and row["label"] == "calculator"
    assert {len(e.split("+")) for e in exprs if "*" not in e} == {3}


def test_reward_reads_only_the_text_after_the_last_mark():
    assert reward("<tool_call>{}</tool_call>10063####10063", "10063") == 1.0
    assert reward("####1 ####10063 ", "10063") == 1.0
    # the tool's result alone (no answer turn) earns nothing, nor does a near miss
    assert reward('<tool_call>{"name":"calculator"}</tool_call>10063', "10063") == 0.0
    assert reward("####10063####1006", "10063") == 0.0
    assert reward("####100634", "10063") == 0.0


def test_trace_mask_covers_exactly_the_assistant_turns(tokenizer):
    row = make_rows(1, 3, "train")[0]
    messages = tool_trace(row, row["reference"])
    ids, mask = trace_ids(tokenizer, messages)
    assert ids == render_ids(tokenizer, messages)
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    expr = row["prompt"][0]["content"]
    call = f'<tool_call>{{"name":"calculator","arguments":{{"expression":"{expr}"}}}}</tool_call>'
    assert trained == f"{call}<eos>{ANSWER_MARK}{row['reference']}<eos>"
    ids, mask = trace_ids(tokenizer, direct_trace(row))
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == f"{ANSWER_MARK}{row['reference']}<eos>"


def test_warmup_trace_equals_the_runtime_episode(tokenizer):
    """The ids the warm-up trains on are the ids an episode has at run time: prompt from the Generator's
    renderer, the model's turns as sampled, the tool result through the episode's ObservationRenderer (the
    calculator of ToolEnvironment computes it). A template that is not prefix-stable, or a tool result
    rendered differently at run time, would train the warm-up on sequences the policy never sees."""
    from streamrft.data.chat import prompt_ids
    from streamrft.envs.base import load_environment
    from streamrft.envs.render import ObservationRenderer

    row = make_rows(1, 5, "eval")[0]
    trace = tool_trace(row, row["reference"])
    want, mask = trace_ids(tokenizer, trace)
    _, context = prompt_ids(tokenizer, row["prompt"])
    env = load_environment("tools", tools=["calculator"])()
    renderer = ObservationRenderer(tokenizer)
    n_model = 0
    for turn in (1, 3):  # the assistant messages: a call, then the answer
        before = render_ids(tokenizer, trace[:turn], add_generation_prompt=True)
        model_ids = render_ids(tokenizer, trace[: turn + 1])[len(before):]  # what the model writes, eos included
        n_model += len(model_ids)
        context = context + model_ids
        step = asyncio.run(env.step(tokenizer.decode(model_ids, skip_special_tokens=True)))
        if turn == 1:
            assert step.observation == row["reference"] and step.info["tool_calls"] == 1 and not step.done
            context = context + renderer.ids(step.role, step.observation, list(context))
        else:
            assert step.done and step.info["tool_calls"] == 0
    assert context == want
    assert sum(mask) == n_model


def test_template_renders_tools_and_refuses_unknown_roles(tokenizer):
    from streamrft.envs.tool_env import TOOL_SCHEMAS

    messages = [{"role": "user", "content": "1+2+3"}]
    text = tokenizer.apply_chat_template(messages, tools=[TOOL_SCHEMAS["calculator"], TOOL_SCHEMAS["python"]],
                                         tokenize=False, add_generation_prompt=True)
    assert text == "<|system|>tools:calculator,python<eos><|user|>1+2+3<eos><|assistant|>"
    with pytest.raises(Exception, match="role critic is not system, user, assistant or tool"):
        tokenizer.apply_chat_template([{"role": "critic", "content": "x"}], tokenize=False)
