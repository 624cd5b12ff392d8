"""Teacher log-prob service messages (on-policy distillation)."""

from __future__ import annotations

from protocols.base import Message


class TeacherRequest(Message, kw_only=True):
    """Log-probs of ``token_ids[prompt_len:]`` given the preceding tokens, per sequence."""

    request_id: str
    token_ids: list[list[int]]
    prompt_lens: list[int]


class TeacherReply(Message, kw_only=True):
    """logprobs[i] has len(token_ids[i]) - prompt_lens[i] entries. ``error`` non-empty = failed."""

    request_id: str
    logprobs: list[list[float]] = []
    error: str = ""
