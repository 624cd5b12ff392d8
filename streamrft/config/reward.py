from __future__ import annotations

from typing import Literal

from streamrft.config.base import Section


class RewardSourceConfig(Section):
    name: str  # component name, exported as its own metric
    type: Literal["rule", "custom", "remote", "model"] = "rule"  # rule (RULES name) | custom (fn spec) | remote | model
    fn: str = ""  # rule name (arith, gsm8k, math, boxed_format) or module:function or path/file.py:function
    # custom: how fn is called and its value read: streamrft | trl | verl | openrlhf | auto (by parameter names;
    # an ambiguous signature is an error), see streamrft/rewards/conventions.py
    convention: Literal["streamrft", "trl", "verl", "openrlhf", "auto"] = "streamrft"
    address: str = ""  # remote: tcp://host:port (ZeroMQ) or http://host:port
    # remote over http: the JSON body spoken; openrlhf = {"query", "prompts", "labels"} -> {"rewards"} (or "scores")
    protocol: Literal["streamrft", "openrlhf"] = "streamrft"
    model_path: str = ""  # model: reward-model directory
    weight: float = 1.0  # weight in the per-label aggregate
    label_weights: dict[str, float] = {}  # per-label weight overriding `weight` for those labels
    labels: list[str] = []  # task labels this source scores; [] = all


class RewardConfig(Section):
    sources: list[RewardSourceConfig] = []  # reward sources; empty is an error unless teacher.mode=pure distillation
    timeout_s: float = 30.0  # per request (remote) or per batch call (local sources)
    max_concurrency: int = 16  # calls in flight to one source: remote requests, or worker threads of a sync function
    retries: int = 3  # retries of a timed-out or failed remote request (same request id)
    # Failure policy (streamrft/runtime/failure_policy.py): stop the run when, in one train step, a source fails
    # more than this fraction of the samples it scored, or when a step trains no sample; 1.0 = never stop.
    max_failed_fraction: float = 0.5
