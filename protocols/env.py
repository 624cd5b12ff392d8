"""Environment service messages (``streamrft serve-env``; ZeroMQ ROUTER/DEALER, or the same messages
as JSON over HTTP).

One episode is one sample's environment. Its requests are keyed by (episode_id, turn): EnvReset is
turn 0, the k-th EnvStep is turn k, EnvClose ends it. The service caches its reply per
(episode_id, turn), so a retried request is answered from the cache and never stepped twice.
"""

from __future__ import annotations

from typing import Any

from protocols.base import Message


class EnvReset(Message, kw_only=True):
    """Start episode ``episode_id`` on data row ``row`` (the prompt's JSON-like fields); turn 0."""

    episode_id: str
    row: dict[str, Any] = {}
    env: str = ""  # the environment the client expects (its env.name); "" = whatever the service runs


class EnvStep(Message, kw_only=True):
    """The model's ``turn``-th turn (1, 2, ...) of the episode, decoded to text."""

    episode_id: str
    turn: int
    action: str


class EnvClose(Message, kw_only=True):
    """End the episode and free its environment; closing an unknown episode is not an error."""

    episode_id: str


class EnvReply(Message, kw_only=True):
    """The answer to any of the three requests (``turn`` 0 for EnvReset, -1 for EnvClose).

    ``error`` non-empty = the request failed; ``code`` says how, so a client can act on it without
    parsing text: "unknown_episode" (the service does not hold the episode, e.g. after a restart),
    "busy" (the queue is full; retry later), "timeout" (the environment passed the per-call timeout),
    "env_error" (the environment raised), "bad_request" (malformed frame, wrong turn, other action).
    """

    episode_id: str
    turn: int = 0
    observation: str | None = None
    reward: float = 0.0
    done: bool = False
    role: str = "tool"
    info: dict[str, Any] = {}
    error: str = ""
    code: str = ""


EnvRequest = EnvReset | EnvStep | EnvClose
