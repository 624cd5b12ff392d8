"""ToolEnvironment (env name "tools") and its calculator: exact answers against Python's own integer
arithmetic, every failure an error observation with its reason and counters, the sandboxed python tool
through a real process."""

from __future__ import annotations

import asyncio
import json
import operator
import random
from fractions import Fraction

import pytest

from streamrft.envs import EnvSpecError, load_environment
from streamrft.envs.tool_env import TOOL_SCHEMAS, ToolEnvironment, ToolError, calculate


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def step(env, text):
    return asyncio.run(env.step(text))


# --- calculator ------------------------------------------------------------------------------------------

def test_calculator_agrees_with_python_integer_arithmetic():
    rng = random.Random(0)
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv, "%": operator.mod}
    for _ in range(300):
        a, b = rng.randint(-10**12, 10**12), rng.randint(1, 10**6) * rng.choice([1, -1])
        sym = rng.choice(list(ops))
        assert calculate(f"{a} {sym} ({b})") == str(ops[sym](a, b)), (a, sym, b)
        q = Fraction(a, b)
        assert calculate(f"{a}/({b})") == (str(q.numerator) if q.denominator == 1 else format(a / b, ".12g"))
    assert calculate("2**10 - -(3+4)*5") == "1059"
    assert calculate("(-2)**-2") == "0.25"
    assert calculate("10/4*2") == "5"  # exact: no float rounding on the way
    assert calculate(" 12345678901234567890 * 98765432109876543210 ") == str(12345678901234567890 * 98765432109876543210)


@pytest.mark.parametrize("expression, message", [
    ("1/0", "division by zero"),
    ("7 % (3-3)", "division by zero"),
    ("1.5 + 1", "only integers are allowed, not 1.5"),
    ("__import__('os').system('ls')", "Call is not allowed: use integers, + - * / // % ** and parentheses"),
    ("x + 1", "Name is not allowed: use integers, + - * / // % ** and parentheses"),
    ("2 ** 100000", "the result would have more than 1000 digits"),
    ("9 ** 9 ** 9", "the result would have more than 1000 digits"),
    ("10 ** 999 * 10 ** 999", "a number in the calculation has more than 1000 digits"),
    ("2 ** (1/2)", "the exponent must be an integer, not 1/2"),
    ("(1 + 2", "cannot parse '(1 + 2': '(' was never closed"),
    ("True + 1", "only integers are allowed, not True"),
])
def test_calculator_refuses_with_a_reason(expression, message):
    with pytest.raises(ToolError) as info:
        calculate(expression)
    assert (info.value.reason, str(info.value)) == ("calculator_error", message)


# --- the environment -------------------------------------------------------------------------------------

def test_a_turn_with_several_calls_answers_each_and_counts_errors():
    env = load_environment("tools", tools=["calculator"])()
    assert isinstance(env, ToolEnvironment) and env.schemas == [TOOL_SCHEMAS["calculator"]]
    turn = ("I will compute. " + call("calculator", expression="12*34") + "<tool_call>{oops}</tool_call>"
            + call("python", code="print(1)") + call("calculator", value="1"))
    result = step(env, turn)
    assert (result.done, result.role, result.reward) == (False, "tool", 0.0)
    contents = [
        "408",
        "error (tool_parse): tool call 2: not valid JSON (Expecting property name enclosed in double quotes at char 1)",
        "error (unknown_tool): tool 'python' is not one of ['calculator']",
        "error (bad_arguments): calculator takes exactly one argument 'expression', got ['value']",
    ]
    assert result.observation == "\n\n".join(contents)
    assert result.info["messages"] == [
        {"role": "tool", "name": "calculator", "content": contents[0]}, {"role": "tool", "content": contents[1]},
        {"role": "tool", "name": "python", "content": contents[2]}, {"role": "tool", "name": "calculator", "content": contents[3]}]
    assert {k: result.info[k] for k in ("tool_calls", "tool_errors", "tool_error_reason", "tool_error_reasons")} == {
        "tool_calls": 4, "tool_errors": 3, "tool_error_reason": "tool_parse",
        "tool_error_reasons": ["tool_parse", "unknown_tool", "bad_arguments"]}
    assert result.info["tool_seconds"] >= 0.0


def test_a_turn_without_a_call_ends_the_episode_and_extra_calls_are_refused():
    env = ToolEnvironment(tools=["calculator"], max_calls_per_turn=2)
    final = step(env, "The answer is 408.")
    assert (final.done, final.observation, final.info["tool_calls"]) == (True, None, 0)
    many = step(env, "".join(call("calculator", expression=f"{i}+1") for i in range(3)))
    assert many.observation.split("\n\n") == ["1", "2", "error (too_many_calls): tool call 3: at most 2 calls per turn"]
    assert many.info["tool_error_reasons"] == ["too_many_calls"]


def test_python_tool_runs_in_the_sandbox_and_a_limit_is_an_observation(tmp_path):
    env = load_environment("tools", tools=["python"],
                           limits={"cpu_seconds": 1, "timeout_s": 30, "work_root": str(tmp_path)})()
    ok = step(env, call("python", code="print(6 * 7)"))
    assert (ok.observation, ok.info["tool_errors"], ok.info["tool_error_reason"]) == ("42", 0, "")
    looping = step(env, call("python", code="print('spinning', flush=True)\nwhile True:\n    pass"))
    assert looping.observation == "error (cpu_limit): spinning"
    # 1 CPU second, whatever the wall time on a shared machine: the wall clock (30 s) did not fire
    assert looping.info["tool_error_reason"] == "cpu_limit" and looping.info["tool_seconds"] < 30
    failing = step(env, call("python", code="raise ValueError('bad input')"))
    assert failing.info["tool_error_reason"] == "error"
    assert failing.observation.startswith("error (error): Traceback (most recent call last):\n  File \"<python tool>\"")
    assert failing.observation.endswith("ValueError: bad input")
    # the episode goes on after its failures
    assert step(env, call("python", code="print(sum(range(5)))")).observation == "10"


def test_bad_kwargs_are_refused_before_any_episode():
    with pytest.raises(ValueError, match=r"env.kwargs.tools for 'tools' is \['shell'\]; each must be one of "
                                         r"\['python', 'calculator'\]"):
        load_environment("tools", tools=["shell"])()
    with pytest.raises(ValueError, match=r"env.kwargs.limits: unknown sandbox limit\(s\) \['cpu'\]"):
        ToolEnvironment(limits={"cpu": 1})
    with pytest.raises(ValueError, match=r"env.kwargs.max_calls_per_turn for 'tools' is 0; it must be an integer >= 1"):
        ToolEnvironment(max_calls_per_turn=0)
    with pytest.raises(EnvSpecError, match=r"env.kwargs: environment 'tools' takes no argument\(s\) \['timeout'\]"):
        load_environment("tools", timeout=3)


def test_max_concurrent_bounds_the_sandboxes_running_at_once(tmp_path):
    code = "import time\nprint(time.time())\ntime.sleep(0.2)\nprint(time.time())"
    make = load_environment("tools", tools=["python"], max_concurrent=1, limits={"work_root": str(tmp_path)})

    async def episodes():
        return await asyncio.gather(*(make().step(call("python", code=code)) for _ in range(3)))

    spans = sorted(tuple(map(float, r.observation.split())) for r in asyncio.run(episodes()))
    assert len(spans) == 3 and all(end - start >= 0.2 for start, end in spans)
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(2)), spans  # one at a time: no overlap


def test_an_episode_with_the_tool_environment_appends_the_rendered_tool_message():
    """ToolEnvironment inside the Generator's episode loop (scripted engine, Qwen2 tokenizer with the
    Hermes tools template): the observation ids are exactly append_messages' ids for the tool message,
    masked out, and the episode's counters sum the step's."""
    from streamrft.engines.base import GeneratedSample
    from streamrft.envs.episode import run_episode
    from streamrft.envs.render import ObservationRenderer
    from streamrft.envs.tools import append_messages, tool_message
    from tests.unit.test_envs_tools import HERMES_TEMPLATE, MERGES, VOCAB, AddedToken, Qwen2Tokenizer

    tok = Qwen2Tokenizer(vocab=dict(VOCAB), merges=list(MERGES), unk_token=None, eos_token="<|im_end|>",
                         pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ("<tool_call>", "</tool_call>")])
    tok.chat_template = HERMES_TEMPLATE
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    turns = [tok.encode(call("calculator", expression="12*34") + "<tool_call>[]</tool_call>", add_special_tokens=False)
             + [eos], tok.encode("It is 408.", add_special_tokens=False) + [eos]]

    class Scripted:
        async def generate_all(self, requests):
            ids = turns.pop(0)
            return [GeneratedSample(requests[0].request_id, ids, [-0.5] * len(ids), "stop", 3, token_versions=[3] * len(ids))]

    env = load_environment("tools", tools=["calculator"])()
    prompt = tok.apply_chat_template([{"role": "user", "content": "12*34?"}], tools=env.schemas,
                                     add_generation_prompt=True, tokenize=True)["input_ids"]
    model_1, model_2 = list(turns[0]), list(turns[1])
    ep = asyncio.run(run_episode(env, Scripted(), ObservationRenderer(tok), prompt, "s0", (0, 0, 0, 0), max_turns=4,
                                 max_tokens=512, max_new_tokens=256))
    content = "408\n\nerror (tool_parse): tool call 2: expected a JSON object with 'name' and 'arguments', got list"
    obs = append_messages(tok, prompt + model_1, [tool_message(content)], tools=env.schemas)
    assert ep.response_ids == model_1 + obs + model_2
    assert ep.loss_mask == [1] * len(model_1) + [0] * len(obs) + [1] * len(model_2)
    assert tok.decode(obs) == f"\n<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert (ep.turns, ep.info["tool_calls"], ep.info["tool_errors"], ep.tool_error_reasons) == (2, 2.0, 1.0, ["tool_parse"])
