"""The environment interface of multi-turn rollouts (issue 18): what an environment is and how one is named.

An episode alternates model turns and environment turns. The Generator calls ``reset(row)`` once per
sample, then, after every model turn, ``step(action)`` with that turn's decoded text; the
:class:`EnvStep` it answers says what to show the model next (rendered with the chat template under
``role``), this turn's reward and whether the episode is over. ``close()`` always runs, also after a
failure. One instance serves one episode, so an environment may keep per-episode state on ``self``.

``load_environment(spec, **kwargs)`` returns a factory (a zero-argument callable making a fresh
instance per episode) for a registered name (see :func:`register_environment`; built-ins live in
:mod:`streamrft.envs.builtin`) or a ``module:Class`` / ``path/to/file.py:Class`` spec, the same
spelling as custom reward functions. ``kwargs`` (the config's ``env.kwargs``) go to the class.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

OBSERVATION_ROLES = ("tool", "user")


@dataclass
class EnvStep:
    """What the environment answers to one model turn."""

    observation: str | None  # text to show the model next (None: nothing to say; ends the episode if done)
    reward: float = 0.0  # this turn's reward (per-turn credit); the final reward comes from reward sources too
    done: bool = False
    role: str = "tool"  # chat role the observation is rendered with ("tool" or "user")
    # e.g. {"tool_calls": 1, "tool_errors": 0, "tool_error_reason": "timeout", "tool_seconds": 0.01}
    info: dict = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One instance per sample (episode); every method is a coroutine."""

    async def reset(self, row: dict) -> str | None:
        """Optional extra text shown before the first model turn (None: just the prompt)."""
        ...

    async def step(self, action: str) -> EnvStep:
        """``action`` is the model turn's decoded text."""
        ...

    async def close(self) -> None:
        ...


class EnvSpecError(ValueError):
    """An environment spec that cannot be resolved (unknown name, bad module:Class, bad kwargs)."""


# name -> class (or factory callable taking **kwargs). Filled by register_environment; the built-ins
# register on import of streamrft.envs.builtin, which _registry() imports lazily (no import cycle).
_REGISTRY: dict[str, Callable[..., Any]] = {}


def register_environment(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Class decorator: make ``cls`` loadable as ``env.name: <name>``."""

    def wrap(cls: Callable[..., Any]) -> Callable[..., Any]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"environment name {name!r} is already registered to {_REGISTRY[name]!r}")
        _REGISTRY[name] = cls
        return cls

    return wrap


def _registry() -> dict[str, Callable[..., Any]]:
    import streamrft.envs.builtin  # noqa: F401  (registers the built-in environments)

    for module in ("streamrft.envs.tool_env",):  # ToolEnvironment (env name "tools") registers itself there
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    return _REGISTRY


def registered_environments() -> list[str]:
    return sorted(_registry())


def _resolve_class(spec: str) -> Callable[..., Any]:
    registry = _registry()
    if spec in registry:
        return registry[spec]
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise EnvSpecError(
            f"env.name {spec!r} is neither a registered environment ({', '.join(sorted(registry))}) "
            "nor 'module:Class' / 'path/to/file.py:Class'"
        )
    from streamrft.user_code import load_user_object  # one loader for user code (reward functions too)

    try:
        return load_user_object(spec, f"env.name {spec!r}", "class")
    except ValueError as exc:
        raise EnvSpecError(str(exc)) from None


def _check_kwargs(cls: Callable[..., Any], spec: str, kwargs: dict) -> None:
    """Refuse env.kwargs the class cannot take, before any episode (and any model) starts."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    accepted = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise EnvSpecError(
            f"env.kwargs: environment {spec!r} takes no argument(s) {unknown} (it takes {sorted(accepted) or 'none'})"
        )
    missing = [
        p.name for p in params
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in kwargs
    ]
    if missing:
        raise EnvSpecError(f"env.kwargs: environment {spec!r} needs argument(s) {missing}")


def load_environment(spec: str, **kwargs: Any) -> Callable[[], Environment]:
    """A factory making one fresh environment per episode, for a registered name or ``module:Class``."""
    if not isinstance(spec, str) or not spec:
        raise EnvSpecError("env.name is empty: nothing to load (empty means single-turn rollouts)")
    cls = _resolve_class(spec)
    _check_kwargs(cls, spec, kwargs)

    def make() -> Environment:
        env = cls(**kwargs)
        for method in ("reset", "step", "close"):
            if not inspect.iscoroutinefunction(getattr(env, method, None)):
                raise EnvSpecError(
                    f"environment {spec!r}: {type(env).__name__}.{method} must be an async method (async def)"
                )
        return env

    return make
