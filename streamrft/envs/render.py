"""Observation messages as token ids, token-in/token-out: only the new suffix is tokenised.

After a model turn the context is ``prompt ids + every earlier turn's ids``, exactly the tokens the
engine sampled or the Generator appended; it is never decoded and re-encoded (that could merge or split
tokens differently, and the behaviour log-probs would then belong to other tokens). An observation is
appended as the ids of the text that the chat template puts between the end of an assistant message and
the start of the next assistant reply:

    closing  = what the template writes after an assistant message's content (e.g. "<eos>", "<|im_end|>\\n")
    suffix   = render([..., assistant, {role, content}], add_generation_prompt) - render([..., assistant])
    new text = (closing minus the stop token the model already sampled) + suffix

Both renders use a fixed two-message stand-in conversation, so the suffix does not depend on earlier
turns (templates render each message on its own; one whose earlier text changes when a message is
appended is refused with an error naming the role).
"""

from __future__ import annotations

import functools
from pathlib import Path

_STAND_IN = [{"role": "user", "content": "\x00u"}, {"role": "assistant", "content": "\x00a"}]


def _template(chat_template: str) -> str | None:
    if chat_template in ("auto", "none", ""):
        return None
    from streamrft.data.chat import _template_file

    return _template_file(str(Path(chat_template).resolve()))


class ObservationRenderer:
    """``ids(role, content, stopped_with)``: the token ids to append after a model turn."""

    def __init__(self, tokenizer, chat_template: str = "auto") -> None:
        if chat_template == "none":
            raise ValueError("env.name needs a chat template to render observations, but data.chat_template=none; "
                             "set data.chat_template=auto or to a Jinja file")
        self.tokenizer = tokenizer
        self.template = _template(chat_template)
        if self.template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"env.name needs a chat template to render observations, but the tokenizer "
                             f"({getattr(tokenizer, 'name_or_path', '?')}) has none; set data.chat_template to a Jinja file")

    def _render(self, messages: list[dict], generation: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=generation)

    @functools.lru_cache(maxsize=8)
    def _parts(self, role: str) -> tuple[str, str, str]:
        """(closing, before-content, after-content) of an observation message of ``role``."""
        try:
            base = self._render(_STAND_IN, False)
            full = self._render([*_STAND_IN, {"role": role, "content": "\x00o"}], True)
        except Exception as exc:
            raise ValueError(f"the chat template cannot render an observation with role {role!r} "
                             f"({type(exc).__name__}: {exc}); have the environment answer with role 'user', or use "
                             "a template that knows this role") from None
        if not full.startswith(base) or "\x00a" not in base or full.count("\x00o") != 1:
            raise ValueError(f"the chat template renders earlier messages differently once a {role!r} message "
                             "follows; token-in/token-out turns need a template that appends messages")
        closing = base[base.rindex("\x00a") + 2:]
        before, after = full[len(base):].split("\x00o")
        return closing, before, after

    def text(self, role: str, content: str, stopped_with: str | None) -> str:
        """The text to append; ``stopped_with``: the decoded stop token that ended the model turn (None:
        the turn ended without one, at its token limit, so the whole closing is added)."""
        closing, before, after = self._parts(role)
        if stopped_with and closing.startswith(stopped_with):
            closing = closing[len(stopped_with):]
        return closing + before + content + after

    def ids(self, role: str, content: str, stopped_with: str | None) -> list[int]:
        return self.tokenizer.encode(self.text(role, content, stopped_with), add_special_tokens=False)
