"""Prompts as text or as chat messages, and the one function that turns either into the model's prompt text.

A row's prompt is a string (used as-is) or a list of messages ``[{"role": ..., "content": ...}]`` (TRL's
conversational format, verl's ``prompt`` column). Messages are rendered with a chat template and
``add_generation_prompt=True``, exactly as ``tokenizer.apply_chat_template`` renders them; the prompt ids
are then ``tokenizer.encode(text, add_special_tokens=False)``, which is what ``apply_chat_template(...,
tokenize=True)`` does with the rendered text, so the two agree token for token.

``data.chat_template``:

- ``auto``: message lists use the tokenizer's own template; text prompts are used as they are;
- ``none``: message lists are refused (a DataError naming file, row and field);
- a path to a Jinja file: that template replaces the tokenizer's for message lists.

``data.system_prompt`` is prepended to a message list as ``{"role": "system", ...}`` unless the list already
starts with a system message (the row's own wins). It applies to message lists only: a text prompt with a
system prompt set is an error, not a silently ignored setting.

The Generator, held-out evaluation, ``streamrft eval`` and ``streamrft chat`` all call :func:`render_prompt`.

Multimodal messages (the Qwen2-VL / Qwen2-Audio formats): a message's content may be a list of parts,
``{"type": "text", "text": ...}``, ``{"type": "image", "image": PATH}``, ``{"type": "video", "video": PATH or
[frame, ...]}``, ``{"type": "audio", "audio": PATH}`` (any media spelling streamrft.data.media reads).
:func:`media_parts` lists the media in placeholder order; the template renders each part as its model's
placeholder (e.g. ``<|vision_start|><|image_pad|><|vision_end|>``) and the media go through the same path as
``data.image_field`` / ``video_field`` / ``audio_field`` (streamrft.models.media_inputs.MediaCodec.prompt).
"""

from __future__ import annotations

import functools
from pathlib import Path

from streamrft.data.errors import DataError

CHAT_TEMPLATE_MODES = ("auto", "none")


def is_messages(value: object) -> bool:
    """True for a prompt given as a list of messages (what the renderer needs a template for)."""
    return isinstance(value, (list, tuple))


def check_messages(value: object, loc: str) -> list[dict]:
    """The messages of a prompt, checked: a non-empty list of {"role": str, "content": str | list of parts}.
    ``loc`` is "<file> row <i> field '<name>'" for the error."""
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{loc}: expected text or a non-empty list of messages [{{'role': ..., 'content': ...}}]")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            keys = sorted(m) if isinstance(m, dict) else type(m).__name__
            raise DataError(f"{loc}: message {j} must be an object with 'role' and 'content' (got {keys})")
        if not isinstance(m["role"], str) or not isinstance(m["content"], (str, list)):
            raise DataError(f"{loc}: message {j} has role {type(m['role']).__name__} and content "
                            f"{type(m['content']).__name__}; expected role text and content text or a list of parts")
        out.append(dict(m))
    return out


MEDIA_PART_KINDS = ("image", "video", "audio")


def has_media_parts(prompt: object) -> bool:
    """True for a message-list prompt with at least one image / video / audio content part."""
    return is_messages(prompt) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in MEDIA_PART_KINDS for p in m["content"]) for m in prompt)


def media_parts(messages: list[dict], loc: str) -> list[tuple[str, object, str]]:
    """The media of a message-list prompt as (kind, value, where) in order (the order of their placeholders
    in the rendered text); DataError naming ``loc``, message and part for a part that is not one of
    text / image / video / audio with its value."""
    out = []
    for j, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for k, part in enumerate(content):
            where = f"{loc} message {j} part {k}"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise DataError(f"{where}: a text part needs 'text' as a string (got {sorted(part)})")
                continue
            if kind not in MEDIA_PART_KINDS:
                got = f"type {kind!r}" if isinstance(part, dict) else type(part).__name__
                raise DataError(f"{where}: a content part must be {{'type': 'text' | 'image' | 'video' | 'audio', ...}} "
                                f"(got {got})")
            if part.get(kind) is None:
                raise DataError(f"{where}: the {kind} part has no {kind!r} value; give it as "
                                f"{{'type': '{kind}', '{kind}': PATH}}")
            out.append((kind, part[kind], where))
    return out


def check_chat_setting(chat_template: str) -> None:
    """ValueError when data.chat_template is neither auto, none nor a readable Jinja file (checked before start)."""
    if chat_template in CHAT_TEMPLATE_MODES:
        return
    path = Path(chat_template)
    if not path.is_file():
        raise ValueError(f"data.chat_template={chat_template!r} is not 'auto', 'none' or an existing Jinja "
                         "template file")
    _template_file(str(path.resolve()))


@functools.lru_cache(maxsize=8)
def _template_file(path: str) -> str:
    """A Jinja template file's text, parsed once so a syntax error is reported with the file's name."""
    import jinja2

    text = Path(path).read_text(encoding="utf-8")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"data.chat_template={path}: line {exc.lineno}: {exc.message}") from None
    return text


def render_prompt(tokenizer, prompt: str | list, chat_template: str = "auto", system_prompt: str = "",
                  loc: str = "prompt", default_template: str | None = None) -> str:
    """The prompt text the model sees for a row's prompt (text, or messages rendered with a chat template).
    ``default_template``: the template ``auto`` uses instead of the tokenizer's (a multimodal processor's own
    chat template, which renders media parts as placeholders)."""
    if not is_messages(prompt):
        if system_prompt:
            raise DataError(f"{loc}: the prompt is text but data.system_prompt is set; a system prompt applies to "
                            "message-list prompts [{'role': 'user', 'content': ...}]; give the prompts as messages "
                            "or clear data.system_prompt")
        return str(prompt)
    if chat_template == "none":
        raise DataError(f"{loc}: the prompt is a list of messages but data.chat_template=none; set "
                        "data.chat_template=auto (the tokenizer's template) or to a Jinja file, or give text prompts")
    messages = check_messages(prompt, loc)
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    template = default_template if chat_template == "auto" else _template_file(str(Path(chat_template).resolve()))
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{loc}: the prompt is a list of messages but the tokenizer "
                        f"({getattr(tokenizer, 'name_or_path', '?')}) has no chat template; set data.chat_template "
                        "to a Jinja template file, or give text prompts")
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                             tokenize=False)
    except Exception as exc:  # jinja2 errors and the template's own raise_exception: name the row
        raise DataError(f"{loc}: the chat template cannot render this row's messages "
                        f"({type(exc).__name__}: {exc})") from None


def prompt_ids(tokenizer, prompt: str | list, chat_template: str = "auto", system_prompt: str = "",
               loc: str = "prompt") -> tuple[str, list[int]]:
    """(rendered text, token ids) of a prompt; the ids equal ``apply_chat_template(..., tokenize=True)``'s."""
    text = render_prompt(tokenizer, prompt, chat_template, system_prompt, loc)
    return text, tokenizer.encode(text, add_special_tokens=False)
