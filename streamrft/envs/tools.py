"""Tool calls in a model's turn and tool results back into the token stream (pure functions, no I/O).

Parsing: Qwen / Hermes-style calls, one JSON object per ``<tool_call>...</tool_call>`` block, any number
per turn::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

A block that is not valid JSON, not an object with a string ``name`` and an object ``arguments`` (a JSON
string holding an object is accepted too: some models write the OpenAI spelling), or that never closes
is a :class:`ToolCallError` with reason ``tool_parse``, never an exception: the environment answers it
as a tool error, and the episode goes on.

Rendering (token-in / token-out): :func:`append_messages` returns the token ids to append after the
conversation so far, for new messages (tool results, a user turn) rendered with the tokenizer's own
chat template, ``tools=`` included. Earlier turns are never re-tokenised: the model's own tokens stay
exactly as sampled, so their behaviour log-probs stay exact. The suffix is found by rendering a probe
conversation ``[user, assistant]`` with and without the new messages; the text between the end of the
assistant's content and the end of the probe is the turn's closing (``<|im_end|>\\n`` for Qwen,
``<eos>`` for the tiny template); the part of it that the model already produced (its stop token) is
not repeated.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)
# Probe texts: letters only, so every tokenizer (the tiny character one too) keeps them as they are.
_PROBE_USER, _PROBE_ASSISTANT = "probeuser", "probeassistant"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCallError:
    """A block that could not be read as a call; ``message`` says which block and why."""

    message: str
    reason: str = "tool_parse"


def has_tool_call(text: str) -> bool:
    """Does the turn try to call a tool at all (a well-formed call or not)?"""
    return TOOL_CALL_OPEN in text


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every ``<tool_call>`` block of ``text`` in order: a ToolCall, or a ToolCallError for a bad one."""
    calls: list[ToolCall | ToolCallError] = []
    end = 0
    for n, match in enumerate(_BLOCK.finditer(text), start=1):
        calls.append(_parse_block(match.group(1), n))
        end = match.end()
    if TOOL_CALL_OPEN in text[end:]:
        calls.append(ToolCallError(f"tool call {len(calls) + 1}: {TOOL_CALL_OPEN} is never closed by {TOOL_CALL_CLOSE}"))
    return calls


def _parse_block(body: str, n: int) -> ToolCall | ToolCallError:
    where = f"tool call {n}"
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCallError(f"{where}: not valid JSON ({exc.msg} at char {exc.pos})")
    if not isinstance(obj, dict):
        return ToolCallError(f"{where}: expected a JSON object with 'name' and 'arguments', got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(f"{where}: 'name' must be a non-empty string, got {name!r}")
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            return ToolCallError(f"{where} ({name}): 'arguments' is a string but not JSON ({exc.msg})")
    if not isinstance(args, dict):
        return ToolCallError(f"{where} ({name}): 'arguments' must be a JSON object, got {type(args).__name__}")
    return ToolCall(name, args)


def _render(tokenizer, messages: list[dict], tools, add_generation_prompt: bool, chat_template) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
    )


def message_suffix_text(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                        chat_template: str | None = None) -> tuple[str, str]:
    """(closing, text): the closing of an assistant turn in this template, and the rendering of
    ``messages`` after it, generation prompt of the next assistant turn included."""
    if not getattr(tokenizer, "chat_template", None) and chat_template is None:
        raise ValueError("the tokenizer has no chat template: tool results cannot be rendered as messages "
                         "(give the model a template, or data.chat_template a Jinja file)")
    probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
    try:
        before = _render(tokenizer, probe, tools, False, chat_template)
        after = _render(tokenizer, probe + list(messages), tools, True, chat_template)
    except Exception as exc:  # jinja errors (raise_exception in the template, unknown role)
        roles = sorted({m.get("role", "?") for m in messages})
        raise ValueError(f"the chat template cannot render message role(s) {roles}: {exc}") from None
    if not after.startswith(before) or _PROBE_ASSISTANT not in before:
        raise ValueError(
            "the chat template renders earlier turns differently once new messages follow them, so the "
            "new messages cannot be appended as a suffix without re-tokenising the conversation")
    closing = before[before.rindex(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT):]
    return closing, after[len(before):]


def _emitted_closing(tokenizer, ids_so_far: list[int], closing: str) -> int:
    """How many leading characters of ``closing`` the conversation already ends with (the model's
    stop token, typically): the longest k with ``closing[:k]`` a suffix of the decoded tail."""
    if not closing or not ids_so_far:
        return 0
    tail = tokenizer.decode(ids_so_far[-(len(closing) + 1):], skip_special_tokens=False)
    for k in range(len(closing), 0, -1):
        if tail.endswith(closing[:k]):
            return k
    return 0


def append_messages(tokenizer, ids_so_far: list[int], messages: list[dict], tools: list[dict] | None = None,
                    chat_template: str | None = None) -> list[int]:
    """Token ids to append after ``ids_so_far`` (ending with a model turn) for ``messages``, rendered
    with the chat template, up to and including the next assistant generation prompt. ``ids_so_far``
    is only read (its tail decoded to see whether the model already closed its turn); never changed."""
    if not messages:
        raise ValueError("append_messages needs at least one message")
    closing, text = message_suffix_text(tokenizer, messages, tools, chat_template)
    done = _emitted_closing(tokenizer, ids_so_far, closing)
    return list(tokenizer.encode(closing[done:] + text, add_special_tokens=False))


def tool_message(content: str, name: str | None = None) -> dict:
    """A ``role: tool`` message (``name`` helps templates that show which tool answered)."""
    message = {"role": "tool", "content": content}
    if name:
        message["name"] = name
    return message
