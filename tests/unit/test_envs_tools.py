"""Tool-call parsing and tool-result rendering (streamrft.envs.tools): exact calls and errors, exact
suffix ids under a Qwen2 tokenizer with a Hermes-style tools template (built here, no hub) and under the
tiny character tokenizer, and a multi-turn conversation whose earlier ids never change."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken
from tokenizers.pre_tokenizers import ByteLevel
from transformers import Qwen2Tokenizer

from streamrft.envs.tools import (
    ToolCall,
    ToolCallError,
    append_messages,
    has_tool_call,
    parse_tool_calls,
    tool_message,
)
from streamrft.models.tiny import build_char_tokenizer

# A Hermes / Qwen2.5-style template written for these tests: tools listed in the system turn, calls as
# <tool_call> JSON, consecutive tool results grouped in one user turn as <tool_response> blocks.
# (transformers renders with trim_blocks: a newline right after a {% tag %} is dropped, hence {{ NL }}.)
HERMES_TEMPLATE = (
    "{% set NL = '\\n' %}"
    "{% if tools %}"
    "<|im_start|>system{{ NL }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}"
    "{{ NL }}{{ NL }}# Tools{{ NL }}{{ NL }}<tools>"
    "{% for tool in tools %}{{ NL }}{{ tool | tojson }}{% endfor %}"
    "{{ NL }}</tools>{{ NL }}{{ NL }}Call a tool as <tool_call>{{ NL }}{\"name\": <name>, \"arguments\": <object>}"
    "{{ NL }}</tool_call><|im_end|>{{ NL }}"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system{{ NL }}{{ messages[0].content }}<|im_end|>{{ NL }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ NL }}<tool_response>{{ NL }}{{ m.content }}{{ NL }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ NL }}{% endif %}"
    "{% elif m.role == 'assistant' and m.tool_calls %}"
    "<|im_start|>assistant{% if m.content %}{{ NL }}{{ m.content }}{% endif %}"
    "{% for call in m.tool_calls %}{{ NL }}<tool_call>{{ NL }}"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}{{ NL }}</tool_call>{% endfor %}"
    "<|im_end|>{{ NL }}"
    "{% else %}"
    "<|im_start|>{{ m.role }}{{ NL }}{{ m.content }}<|im_end|>{{ NL }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ NL }}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "exact integer arithmetic",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}, "required": ["expression"]}}}]
BYTES = sorted(ByteLevel.alphabet())
VOCAB = {c: i for i, c in enumerate(BYTES)}
MERGES = [("u", "s"), ("e", "r"), ("us", "er")]
for _a, _b in MERGES:
    VOCAB[_a + _b] = len(VOCAB)


@pytest.fixture(scope="module")
def qwen_tok():
    tok = Qwen2Tokenizer(vocab=dict(VOCAB), merges=list(MERGES), unk_token=None, eos_token="<|im_end|>",
                         pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    # as Qwen2.5 has them: added, not special, no stripping of the newlines around them
    tok.add_tokens([AddedToken(t, lstrip=False, rstrip=False, normalized=False, special=False)
                    for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")])
    tok.chat_template = HERMES_TEMPLATE
    return tok


def chars(text: str) -> list[int]:
    """Ids of ``text`` one byte-level character each (no merge applies to the texts used with it)."""
    return [VOCAB[ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(c)[0][0]] for c in text]


def special(tok, name: str) -> int:
    return tok.convert_tokens_to_ids(name)


# --- parsing ---------------------------------------------------------------------------------------------

def test_several_calls_in_one_turn_in_order():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
            ' and <tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call> done')
    assert has_tool_call(text)
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "12*34"}),
                                      ToolCall("python", {"code": "print(1)"})]
    assert parse_tool_calls("The answer is 408.") == [] and not has_tool_call("The answer is 408.")
    assert parse_tool_calls('<tool_call>{"name": "noargs"}</tool_call>') == [ToolCall("noargs", {})]


@pytest.mark.parametrize("body, message", [
    ('{"name": "calculator", "arguments": {"expression": "1+"', "tool call 1: not valid JSON (Expecting ',' delimiter at char 55)"),
    ('["calculator"]', "tool call 1: expected a JSON object with 'name' and 'arguments', got list"),
    ('{"arguments": {}}', "tool call 1: 'name' must be a non-empty string, got None"),
    ('{"name": "calc", "arguments": [1, 2]}', "tool call 1 (calc): 'arguments' must be a JSON object, got list"),
    ('{"name": "calc", "arguments": "x=1"}', "tool call 1 (calc): 'arguments' is a string but not JSON (Expecting value)"),
])
def test_a_malformed_call_is_a_tool_parse_error_not_an_exception(body, message):
    assert parse_tool_calls(f"<tool_call>{body}</tool_call>") == [ToolCallError(message, "tool_parse")]


def test_good_and_bad_calls_are_kept_apart_and_an_unclosed_call_is_an_error():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>nope</tool_call><tool_call>{"name": "b"'
    assert parse_tool_calls(text) == [
        ToolCall("a", {}),
        ToolCallError("tool call 2: not valid JSON (Expecting value at char 0)"),
        ToolCallError("tool call 3: <tool_call> is never closed by </tool_call>"),
    ]


# --- rendering: Qwen2 tokenizer, Hermes tools template -------------------------------------------------

def test_tool_results_after_a_closed_turn_exact_ids(qwen_tok):
    im_start, im_end = special(qwen_tok, "<|im_start|>"), special(qwen_tok, "<|im_end|>")
    t_open, t_close = special(qwen_tok, "<tool_response>"), special(qwen_tok, "</tool_response>")
    turn = qwen_tok.encode('<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>',
                           add_special_tokens=False) + [im_end]
    suffix = append_messages(qwen_tok, turn, [tool_message("42", "calculator"), tool_message("7")], tools=TOOLS)
    nl = chars("\n")
    expected = (nl + [im_start, VOCAB["user"]] + nl + [t_open] + nl + chars("42") + nl + [t_close]
                + nl + [t_open] + nl + chars("7") + nl + [t_close] + [im_end] + nl
                + [im_start] + chars("assistant") + nl)
    assert suffix == expected
    # a turn cut by the token budget (no <|im_end|>) is closed by the suffix: <|im_end|> is not the model's
    assert append_messages(qwen_tok, turn[:-1], [tool_message("42")], tools=TOOLS)[:2] == [im_end] + nl


def test_multi_turn_ids_are_the_template_rendering_and_earlier_ids_never_change(qwen_tok):
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 12*34?"}]
    ids = qwen_tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)["input_ids"]
    im_end = special(qwen_tok, "<|im_end|>")
    turns = [('<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>', ["408"]),
             ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "408+1"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2**3"}}\n</tool_call>', ["409", "8"]),
             ("The answer is 408.", None)]
    for text, results in turns:
        model_ids = qwen_tok.encode(text, add_special_tokens=False) + [im_end]
        before = list(ids)
        ids = ids + model_ids
        messages.append({"role": "assistant", "content": text})
        if results is None:
            break
        new = [tool_message(r, "calculator") for r in results]
        ids = ids + append_messages(qwen_tok, ids, new, tools=TOOLS)
        messages.extend(new)
        assert ids[:len(before)] == before and ids[len(before):len(before) + len(model_ids)] == model_ids
    # The whole stream is exactly the template's rendering of the finished conversation (the last turn
    # ends with the model's <|im_end|>; the template adds the newline after it).
    full = qwen_tok.apply_chat_template(messages, tools=TOOLS, tokenize=True)["input_ids"]
    assert ids + qwen_tok.encode("\n", add_special_tokens=False) == full
    assert qwen_tok.decode(ids).count('"name": "calculator"') == 1 + 3  # tools= in the system turn, 3 calls


# --- rendering: tiny character tokenizer ---------------------------------------------------------------

def test_tiny_chat_template_exact_ids_and_a_role_it_cannot_render(tmp_path):
    alphabet = "0123456789+*= abcdefghijklmnopqrstuvwxyz"
    tok = build_char_tokenizer(str(tmp_path), alphabet, chat=True)
    ch = {c: 3 + i for i, c in enumerate(alphabet)}
    user, assistant = tok.convert_tokens_to_ids("<|user|>"), tok.convert_tokens_to_ids("<|assistant|>")
    model_turn = [ch["4"], ch["2"], tok.eos_token_id]
    assert append_messages(tok, model_turn, [{"role": "user", "content": "ok 7"}]) == [
        user, ch["o"], ch["k"], ch[" "], ch["7"], tok.eos_token_id, assistant]
    # without the model's <eos>, the suffix closes the turn first
    assert append_messages(tok, model_turn[:-1], [{"role": "user", "content": "7"}]) == [
        tok.eos_token_id, user, ch["7"], tok.eos_token_id, assistant]
    with pytest.raises(ValueError, match=r"the chat template cannot render message role\(s\) \['tool'\]: "
                                         r"role tool is not system, user or assistant"):
        append_messages(tok, model_turn, [tool_message("42")])


def test_a_template_that_rewrites_earlier_turns_is_refused(qwen_tok, tmp_path):
    # renders only the last message: appending changes what came before
    template = "{% for m in messages %}{% if loop.last %}{{ m.role }}:{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match=r"renders earlier turns differently once new messages follow them"):
        append_messages(qwen_tok, [1, 2], [tool_message("1")], chat_template=template)
    plain = build_char_tokenizer(str(tmp_path), "abc")
    with pytest.raises(ValueError, match=r"the tokenizer has no chat template"):
        append_messages(plain, [3], [{"role": "user", "content": "a"}])
