"""Remote reward service messages (ZeroMQ ROUTER/DEALER; HTTP JSON mode uses its own shape)."""

from __future__ import annotations

from typing import Any

from protocols.base import Message
from protocols.pipeline import MediaRef


class RewardItem(Message, kw_only=True):
    """One sample to score. ``prompt`` and ``response`` are decoded text."""

    sample_id: str
    prompt: str
    response: str
    reference: str = ""
    label: str = "default"
    images: list[str] = []  # base64-encoded image bytes, each encoded once
    # the data row's other JSON-like fields (TRL's extra columns, verl's extra_info); see
    # streamrft.rewards.conventions.reward_columns
    columns: dict[str, Any] = {}
    # the prompt's media by reference (path + sha256 on a filesystem the scorer shares), never pixels: a
    # reward model that reads media (streamrft.rm.reward.ModelReward) decodes them, hash-checked
    media: list[MediaRef] = []


class RewardRequest(Message, kw_only=True):
    """request_id is idempotent: a retried request carries the same id and gets the same answer."""

    request_id: str
    items: list[RewardItem]


class RewardReply(Message, kw_only=True):
    """rewards[i] scores items[i]; components[name][i] likewise. ``error`` non-empty = failed."""

    request_id: str
    rewards: list[float] = []
    components: dict[str, list[float]] = {}
    error: str = ""
