"""Reward functions for benchmarks/reward_latency.py: the arith rule, instantly or after 100 ms."""

import time

from streamrft.rewards.rules import RULES

DELAY_S = 0.1


def arith_instant(response: str, reference: str) -> float:
    return RULES["arith"](response, reference)


def arith_slow(response: str, reference: str) -> float:
    time.sleep(DELAY_S)  # a remote judge, a sandbox, a slow service
    return RULES["arith"](response, reference)
