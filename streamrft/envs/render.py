"""Observation messages as token ids for the Generator's episodes, token-in/token-out.

After a model turn the context is ``prompt ids + every earlier turn's ids``, exactly the tokens the
engine sampled or the Generator appended; it is never decoded and re-encoded (that could merge or split
tokens differently, and the behaviour log-probs would then belong to other tokens). An observation is
appended as the ids of only the new suffix: the assistant turn's closing (less the stop token the model
already sampled), the message rendered by the chat template, and the next assistant generation prompt.
The suffix itself is computed by ``streamrft.envs.tools.append_messages`` (one implementation for tool
results and plain observations); this module adds the run's ``data.chat_template`` setting and checks
that the template can render an observation at all (``validate_env`` calls it before any model loads).
"""

from __future__ import annotations

from pathlib import Path


class ObservationRenderer:
    """``ids(role, content, context_ids)``: the token ids to append after a model turn."""

    def __init__(self, tokenizer, chat_template: str = "auto") -> None:
        if chat_template == "none":
            raise ValueError("env.name needs a chat template to render observations, but data.chat_template=none; "
                             "set data.chat_template=auto or to a Jinja file")
        self.tokenizer = tokenizer
        self.template = None
        if chat_template not in ("auto", ""):
            from streamrft.data.chat import _template_file

            self.template = _template_file(str(Path(chat_template).resolve()))
        if self.template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"env.name needs a chat template to render observations, but the tokenizer "
                             f"({getattr(tokenizer, 'name_or_path', '?')}) has none; set data.chat_template to a Jinja file")

    def ids(self, role: str, content: str, context_ids: list[int] | str | None) -> list[int]:
        """``context_ids``: the ids so far (prompt + earlier turns), whose tail shows whether the model closed
        its turn; or, for callers that keep no context (batched evaluation loops), the decoded stop token
        that ended the model turn (None: it ended at its token limit, so the whole closing is added)."""
        from streamrft.envs.tools import append_messages, message_suffix_text

        message = [{"role": role, "content": content}]
        try:
            if isinstance(context_ids, list):
                return append_messages(self.tokenizer, context_ids, message, chat_template=self.template)
            closing, text = message_suffix_text(self.tokenizer, message, chat_template=self.template)
            if context_ids and closing.startswith(context_ids):
                closing = closing[len(context_ids):]
            return list(self.tokenizer.encode(closing + text, add_special_tokens=False))
        except ValueError as exc:
            raise ValueError(f"observation with role {role!r}: {exc}; have the environment answer with role "
                             "'user', or use a template that renders this role") from None

    def check(self, role: str = "user") -> None:
        """Raise ValueError if the template cannot render an observation of ``role`` as a suffix."""
        from streamrft.envs.tools import message_suffix_text

        try:
            message_suffix_text(self.tokenizer, [{"role": role, "content": "x"}], chat_template=self.template)
        except ValueError as exc:
            raise ValueError(f"observation with role {role!r}: {exc}") from None
