"""Rewards: rule rewards (RULES), custom functions, the remote client and service, and the aggregator.

Light to import (no torch, no zmq until a remote source or the service is used).
"""

from streamrft.rewards.custom import RewardFunction, batched, load_reward_function
from streamrft.rewards.rules import RULES
from streamrft.rewards.scorer import RewardOutcome, RewardScorer, build_reward_scorer

__all__ = [
    "RULES",
    "RewardFunction",
    "RewardOutcome",
    "RewardScorer",
    "batched",
    "build_reward_scorer",
    "load_reward_function",
]
