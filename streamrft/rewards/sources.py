"""Reward sources: one configured scorer (rule, custom function, remote service) plus where it applies.

Every backend has the same small shape, ``async score(items) -> list[float | Exception]`` (one entry
per item, an exception where that item could not be scored) and ``async close()``. The backend type
is picked by ``reward.sources[*].type`` through the explicit :data:`SOURCE_BUILDERS` dict.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from protocols import RewardItem
from streamrft.config.base import ConfigError
from streamrft.config.reward import RewardConfig, RewardSourceConfig
from streamrft.models.hub import looks_like_hub_id
from streamrft.rewards.conventions import ConventionError, resolve_convention
from streamrft.rewards.custom import RewardFunction, load_reward_function
from streamrft.rewards.rules import RULES


class RewardBackend(Protocol):
    async def score(self, items: Sequence[RewardItem]) -> list[float | Exception]: ...

    async def close(self) -> None: ...


class LocalFunctionBackend:
    """A rule or custom function run in this process (sync functions in the function's own bounded
    thread pool, see streamrft/rewards/bounded.py)."""

    def __init__(self, fn: RewardFunction) -> None:
        self.fn = fn

    async def score(self, items: Sequence[RewardItem]) -> list[float | Exception]:
        return await self.fn.score(items)

    async def close(self) -> None:
        self.fn.close()  # never joins a call hung in user code


def resolve_reward_function(spec: str, convention: str = "streamrft") -> RewardFunction:
    """A built-in rule name (see RULES), a custom ``module:function`` / ``file.py:function`` spec, or
    ``model:DIR`` with DIR an existing directory (or ``model:org/name``, its hub id in the local Hugging Face
    cache): a reward model trained by ``streamrft train-rm``
    (streamrft.rm.reward.ModelReward, which has the same ``name`` / ``async score(items)`` shape). A
    ``model:name`` whose DIR is not a directory is read as a custom function in a module called ``model``.

    ``convention`` (``serve-reward --convention``): how a custom function is called (streamrft, trl, verl,
    openrlhf or auto; streamrft.rewards.conventions); ValueError for a signature that does not fit it.
    Rules and reward models are StreamRFT's own: another convention for them is an error."""
    rm = spec.removeprefix("model:") if spec.startswith("model:") else None
    # model:DIR, or model:org/name (a hub id: a function name has no '/'), resolved by ModelReward
    is_rm = rm is not None and (os.path.isdir(rm) or ("/" in rm and looks_like_hub_id(rm)))
    builtin = spec in RULES or is_rm
    if builtin and convention not in ("streamrft", "auto"):
        raise ValueError(f"--convention {convention} is for custom functions (module:function); {spec!r} is a "
                         "built-in rule or reward model, which StreamRFT calls itself: drop --convention")
    if is_rm:
        from streamrft.rm.reward import ModelReward

        return ModelReward(rm)  # type: ignore[return-value]
    if spec in RULES:
        return RewardFunction(RULES[spec], name=spec)
    if ":" not in spec:
        raise ValueError(f"reward function {spec!r} is neither a rule ({', '.join(sorted(RULES))}) nor module:function")
    fn = load_reward_function(spec)
    try:
        resolved = resolve_convention(fn, convention, f"--fn {spec}", key="--convention")
    except ConventionError as exc:
        raise ValueError(str(exc)) from None
    return RewardFunction(fn, name=spec, convention=resolved)


def _build_rule(src: RewardSourceConfig, cfg: RewardConfig) -> tuple[RewardBackend, float]:
    if src.fn not in RULES:
        raise ConfigError(f"reward source {src.name!r}: fn={src.fn!r} is not a rule; choose one of {sorted(RULES)}")
    return LocalFunctionBackend(RewardFunction(RULES[src.fn], name=src.fn, max_workers=cfg.max_concurrency)), cfg.timeout_s


def load_source_function(src: RewardSourceConfig) -> tuple[object, str]:
    """The custom function of ``src`` and its resolved convention (streamrft.rewards.conventions);
    ConfigError naming the source for a bad spec or a signature that does not fit the convention.
    Run at validation (before any model is loaded) and again when the scorer is built."""
    try:
        fn = load_reward_function(src.fn)
    except ValueError as exc:
        raise ConfigError(f"reward source {src.name!r} (reward.sources[*].fn): {exc}") from None
    try:
        convention = resolve_convention(fn, src.convention, f"reward source {src.name!r} ({src.fn})")
    except ConventionError as exc:
        raise ConfigError(str(exc)) from None
    return fn, convention


def _build_custom(src: RewardSourceConfig, cfg: RewardConfig) -> tuple[RewardBackend, float]:
    fn, convention = load_source_function(src)
    reward_fn = RewardFunction(fn, name=src.fn, max_workers=cfg.max_concurrency, convention=convention, source=src.name)
    return LocalFunctionBackend(reward_fn), cfg.timeout_s


def check_protocol(src: RewardSourceConfig) -> None:
    """protocol=openrlhf is a JSON body: it needs an http(s) address."""
    if src.protocol != "streamrft" and not src.address.startswith(("http://", "https://")):
        raise ConfigError(
            f"reward source {src.name!r}: protocol={src.protocol!r} is an HTTP JSON body, but address="
            f"{src.address!r} is not http://host:port[/path]; use an http address or protocol: streamrft"
        )


def _build_remote(src: RewardSourceConfig, cfg: RewardConfig) -> tuple[RewardBackend, float]:
    from streamrft.rewards.remote import RemoteRewardClient

    check_protocol(src)
    client = RemoteRewardClient(src.address, cfg.timeout_s, cfg.max_concurrency, cfg.retries, protocol=src.protocol)
    return client, client.deadline_s


def _build_model(src: RewardSourceConfig, cfg: RewardConfig) -> tuple[RewardBackend, float]:
    from streamrft.rm.reward import ModelReward

    if not src.model_path:
        raise ConfigError(f"reward source {src.name!r}: model_path is empty; set reward.sources[*].model_path to a "
                          "directory written by `streamrft train-rm`")
    try:
        return ModelReward(src.model_path), cfg.timeout_s
    except ValueError as exc:
        raise ConfigError(f"reward source {src.name!r} (reward.sources[*].model_path): {exc}") from None


# type -> builder returning (backend, the longest one score() call may take before it is abandoned).
SOURCE_BUILDERS: dict[str, Callable[[RewardSourceConfig, RewardConfig], tuple[RewardBackend, float]]] = {
    "rule": _build_rule,
    "custom": _build_custom,
    "remote": _build_remote,
    "model": _build_model,  # a trained SRM / GRM directory (streamrft.rm.reward.ModelReward), run in process
}


@dataclass
class RewardSource:
    """A backend plus its name (the component name), labels and weights."""

    name: str
    backend: RewardBackend
    deadline_s: float  # a score() call longer than this is abandoned and fails its items
    weight: float = 1.0
    label_weights: dict[str, float] = field(default_factory=dict)
    labels: list[str] = field(default_factory=list)  # [] = every label

    def applies_to(self, label: str) -> bool:
        return not self.labels or label in self.labels

    def weight_for(self, label: str) -> float:
        return self.label_weights.get(label, self.weight)


def build_source(src: RewardSourceConfig, cfg: RewardConfig) -> RewardSource:
    builder = SOURCE_BUILDERS.get(src.type)
    if builder is None:
        raise ConfigError(
            f"reward source {src.name!r}: type={src.type!r} is not available; choose one of {sorted(SOURCE_BUILDERS)}"
        )
    backend, deadline_s = builder(src, cfg)
    return RewardSource(
        name=src.name,
        backend=backend,
        deadline_s=deadline_s,
        weight=src.weight,
        label_weights=dict(src.label_weights),
        labels=list(src.labels),
    )
