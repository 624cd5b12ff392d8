"""The calculator demo's task: arithmetic the tiny model cannot do in its head, and a calculator it may call.

Problems are ``a*b`` (a three-digit times a two-digit number) and ``a+b+c`` (three three-digit numbers). A
two-layer, 64-wide character model does not learn to multiply or to carry across three operands from a few
hundred examples; it does learn to copy the expression into a tool call and the tool's result into its
answer. Every problem belongs to one split by a stable hash of its text (``pipelines/arith/task.split_of``),
so train and held-out sets are disjoint whatever ``n`` and ``seed`` are.

Rows are jsonl with the prompt as chat messages (the episode is a chat: user, assistant, tool, assistant):
``{"prompt": [{"role": "user", "content": "347*29"}], "reference": "10063", "label": "calculator"}``.

The chat template speaks Hermes/Qwen-style tool calls in a compact form the character tokenizer can spell:
an assistant turn with ``tool_calls`` renders as ``<tool_call>{"name":"calculator","arguments":{...}}</tool_call>``,
a tool result as ``<|tool|>RESULT<eos>``, and ``tools=`` as one system line naming the tools. The final
answer follows ``####`` (``reward`` reads only what follows the last one).
"""

from __future__ import annotations

import random
import string
from typing import Sequence

from pipelines.arith.task import split_of

LABEL = "calculator"
# Every printable ASCII character: tool calls are JSON, and tool errors are English.
CALC_ALPHABET = "".join(ch for ch in string.printable if ch not in "\t\n\r\x0b\x0c")
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
# Added as ordinary (non-special) tokens: decoding keeps them, so a decoded turn still shows its tool call
# to the parser; one token each keeps the traces short.
TAG_TOKENS = ("<tool_call>", "</tool_call>")
KINDS = ("mul", "sum3")
ANSWER_MARK = "####"  # the final answer follows it (GSM8K's convention), in the episode's last assistant turn
# "<|role|>content<eos>" per message; tool calls after the content; the tools list as one system line.
# Prefix-stable (rendering messages[:k] is a prefix of rendering messages), so a tool result's ids are the
# suffix the new message adds and no earlier turn is re-tokenised.
CHAT_TEMPLATE = (
    "{%- if tools -%}<|system|>tools:"
    "{%- for tool in tools -%}{{ tool['function']['name'] if tool['function'] is defined else tool['name'] }}"
    "{%- if not loop.last -%},{%- endif -%}{%- endfor -%}{{ eos_token }}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('role ' + message['role'] + ' is not system, user, assistant or tool') }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- elif message['content'] -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "<tool_call>{\"name\":{{ fn['name'] | tojson }},\"arguments\":"
    "{%- if fn['arguments'] is string -%}{{ fn['arguments'] }}"
    "{%- else -%}{{ fn['arguments'] | tojson(separators=(',', ':')) }}{%- endif -%}}</tool_call>"
    "{%- endfor -%}{%- endif -%}"
    "{{ eos_token }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)


def build_tokenizer(out_dir: str):
    """The character tokenizer over ``CALC_ALPHABET`` plus the role tokens (special), the tool-call tags
    (ordinary added tokens) and ``CHAT_TEMPLATE``; saved to ``out_dir``."""
    from streamrft.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer(out_dir, CALC_ALPHABET)
    tokenizer.add_special_tokens({"additional_special_tokens": list(ROLE_TOKENS)})
    tokenizer.add_tokens(list(TAG_TOKENS))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def format_problem(kind: str, operands: Sequence[int]) -> tuple[str, str]:
    """(expression, answer): ("mul", (347, 29)) -> ("347*29", "10063"); ("sum3", (a, b, c)) -> ("a+b+c", ...)."""
    if kind == "mul":
        a, b = operands
        return f"{a}*{b}", str(a * b)
    if kind == "sum3":
        return "+".join(str(x) for x in operands), str(sum(operands))
    raise ValueError(f"kind={kind!r} must be one of {KINDS}")


def make_problem(rng: random.Random, kind: str) -> tuple[str, str]:
    """A random problem of ``kind``: mul = [100, 999] * [10, 99]; sum3 = three numbers in [100, 999]."""
    if kind == "mul":
        return format_problem(kind, (rng.randint(100, 999), rng.randint(10, 99)))
    if kind == "sum3":
        return format_problem(kind, (rng.randint(100, 999), rng.randint(100, 999), rng.randint(100, 999)))
    raise ValueError(f"kind={kind!r} must be one of {KINDS}")


def make_rows(n: int, seed: int, split: str, eval_fraction: float = 0.1) -> list[dict]:
    """``n`` distinct problems of ``split`` (half mul, half sum3, interleaved), drawn with ``seed``."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} must be 'train' or 'eval'")
    rng = random.Random(f"{seed}-{split}")
    seen: set[str] = set()
    rows: list[dict] = []
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 100 * n + 1000:
            raise ValueError(f"could not draw {n} distinct {split} problems; lower n")
        expr, answer = make_problem(rng, KINDS[len(rows) % len(KINDS)])
        if expr in seen or split_of(expr, eval_fraction) != split:
            continue
        seen.add(expr)
        rows.append({"prompt": [{"role": "user", "content": expr}], "reference": answer, "label": LABEL})
    return rows


def expression_of(row: dict) -> str:
    """The arithmetic expression of a row: the last user message's content."""
    users = [m["content"] for m in row["prompt"] if m["role"] == "user"]
    if not users:
        raise ValueError(f"row has no user message: {row['prompt']!r}")
    return users[-1]


def tool_trace(row: dict, result: str) -> list[dict]:
    """The messages of a tool-using episode: ask, call the calculator, read its ``result``, answer."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression_of(row)}}}
    return [*row["prompt"], {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": result}, {"role": "assistant", "content": ANSWER_MARK + result}]


def direct_trace(row: dict) -> list[dict]:
    """The messages of an episode answered without the tool."""
    return [*row["prompt"], {"role": "assistant", "content": ANSWER_MARK + row["reference"]}]


def render_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def trace_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a whole episode: mask 1 on what the model writes (each assistant turn's
    content, tool calls and closing eos), 0 on the prompt, the role markers and the tool's results."""
    ids: list[int] = []
    mask: list[int] = []
    for k, message in enumerate(messages):
        upto = render_ids(tokenizer, messages[: k + 1], tools)
        if upto[: len(ids)] != ids:
            raise ValueError(f"the chat template is not prefix-stable at message {k} ({message['role']})")
        if message["role"] == "assistant":
            # the ids up to this turn's content: the rendering of messages[:k] plus the assistant marker
            before = render_ids(tokenizer, messages[:k], tools, add_generation_prompt=True)
            mask += [0] * (len(before) - len(ids)) + [1] * (len(upto) - len(before))
        else:
            mask += [0] * (len(upto) - len(ids))
        ids = upto
    return ids, mask


def reward(response: str, reference: str) -> float:
    """The reward source of config.yaml (``type: custom``): 1.0 when the text after the episode's last ``####``
    is exactly the reference. The Generator decodes the whole episode (tool calls, the tool's results and the
    answer) as one text; the ``####`` marker keeps a tool result from counting as an answer the model never gave."""
    if "####" not in response:
        return 0.0
    return 1.0 if response.rsplit("####", 1)[1].strip() == reference.strip() else 0.0
