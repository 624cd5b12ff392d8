"""Custom reward functions named by a spec string, and the one async calling convention for all of them.

A spec is ``package.module:function`` (imported) or ``path/to/file.py:function`` (loaded from the
file; relative paths are relative to the working directory).

Two shapes of function are accepted, sync or ``async def``:

* per sample: ``fn(response, reference, prompt=..., label=..., images=...) -> float``; ``prompt``, ``label`` and ``images`` (base64 strings)
  are passed only when the signature accepts them (by name or through ``**kwargs``);
* batched: ``fn(responses, references, prompts=..., labels=...) -> list[float]`` (one float per
  sample, same order), declared with the :func:`batched` decorator or by setting the attribute
  ``fn.batched = True``. Batch it when the function has a per-call cost worth sharing (a model, a
  sandbox, an HTTP call).

:class:`RewardFunction` wraps either shape behind ``async score(items) -> list[float | Exception]``:
a per-sample function that raises fails that sample only; a batched one that raises, or returns the
wrong number of values, fails the whole batch. Sync functions run in the function's own bounded pool
of daemon threads (:class:`streamrft.rewards.bounded.BoundedExecutor`, ``max_workers`` =
``reward.max_concurrency``), never in the event loop's default executor that the hf engine uses: a
call that never returns fails the samples of its ``score`` call (the reward stage scores what arrives
together in one call) at the caller's deadline and blocks neither the engine nor shutdown. A per-sample
sync function given many samples runs them in at most ``max_workers`` thread jobs, each over a slice.

Functions written for TRL, verl or OpenRLHF keep their own signatures: ``reward.sources[].convention``
(``RewardFunction(..., convention=)``) hands the call to an adapter in streamrft.rewards.conventions.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable, Sequence

from protocols import RewardItem
from streamrft.rewards.bounded import BoundedExecutor
from streamrft.rewards.conventions import ConventionError, adapter_for
from streamrft.user_code import load_user_object


class BatchRewardError(RuntimeError):
    """A batched reward function failed for its whole batch (raised, or returned the wrong length)."""


def batched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as batched: called once with lists (responses, references, prompts=, labels=)."""
    fn.batched = True  # type: ignore[attr-defined]
    return fn


def load_reward_function(spec: str) -> Callable[..., Any]:
    """Import the function named by ``module:function`` or ``path/to/file.py:function``.

    Raises ValueError naming the spec when it is malformed, the module or file is missing, or the
    module has no such callable.
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name or not name.isidentifier():
        raise ValueError(
            f"reward function spec {spec!r} is not 'module:function' or 'path/to/file.py:function'"
        )
    return load_user_object(spec, f"reward function spec {spec!r}", "function")


def _accepted_keywords(fn: Callable[..., Any], names: Sequence[str]) -> set[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: pass positional arguments only
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return set(names)
    return {p.name for p in params if p.name in names}


class RewardFunction:
    """One reward function (rule or custom) behind ``async score(items) -> list[float | Exception]``."""

    def __init__(self, fn: Callable[..., Any], name: str, max_workers: int = 16, convention: str = "streamrft",
                 source: str = "") -> None:
        """``convention``: a resolved convention (streamrft.rewards.conventions.resolve_convention);
        ``source``: the reward source's name, quoted in errors of foreign conventions."""
        self.fn = fn
        self.name = name
        self.convention = convention
        self.adapter = None if convention == "streamrft" else adapter_for(fn, convention)
        self._where = f"reward source {source or name!r} ({convention} convention, {name})"
        self.is_batched = self.adapter.batched if self.adapter is not None else bool(getattr(fn, "batched", False))
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
        kw_names = ("prompts", "labels", "images") if self.is_batched else ("prompt", "label", "images")
        self._keywords = _accepted_keywords(fn, kw_names)
        self.executor = None if self.is_async else BoundedExecutor(f"reward-{name}", max_workers)

    async def _call(self, *args: Any, **kwargs: Any) -> Any:
        if self.executor is None:
            return await self.fn(*args, **kwargs)
        return await self.executor.run(self.fn, *args, **kwargs)

    def close(self) -> None:
        """Release the worker threads; a call still running in user code is abandoned, not joined."""
        if self.executor is not None:
            self.executor.close()

    async def score(self, items: Sequence[RewardItem]) -> list[float | Exception]:
        if self.adapter is not None:
            return await self._score_adapted(items)
        if self.is_batched:
            return await self._score_batched(items)
        if len(items) == 1:  # no gather, no task
            return [await self._score_one(items[0])]
        if self.executor is not None:
            # a sync per-sample function over many samples (the reward stage batches what arrives together):
            # one thread job per slice, as many slices as the source has threads, instead of one job (a thread
            # hand-off and an event-loop wake-up) per sample
            n = min(self.executor.max_workers, len(items))
            slices = [items[i::n] for i in range(n)]
            done = await asyncio.gather(*(self.executor.run(self._score_slice, part) for part in slices))
            out: list[float | Exception] = [0.0] * len(items)
            for i, values in enumerate(done):
                out[i::n] = values
            return out
        return list(await asyncio.gather(*(self._score_one(item) for item in items)))

    def _kwargs(self, item: RewardItem) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if "prompt" in self._keywords:
            kwargs["prompt"] = item.prompt
        if "label" in self._keywords:
            kwargs["label"] = item.label
        if "images" in self._keywords:
            kwargs["images"] = list(item.images)  # base64 strings, one per distinct image of the sample
        return kwargs

    async def _score_one(self, item: RewardItem) -> float | Exception:
        try:
            return _as_float(await self._call(item.response, item.reference, **self._kwargs(item)))
        except Exception as exc:  # reported per sample by the caller, never dropped
            return exc

    def _score_slice(self, items: Sequence[RewardItem]) -> list[float | Exception]:
        """In a worker thread: each sample's value, or the exception its call raised (that sample fails alone)."""
        out: list[float | Exception] = []
        for item in items:
            try:
                out.append(_as_float(self.fn(item.response, item.reference, **self._kwargs(item))))
            except Exception as exc:
                out.append(exc)
        return out

    async def _score_batched(self, items: Sequence[RewardItem]) -> list[float | Exception]:
        kwargs: dict[str, Any] = {}
        if "prompts" in self._keywords:
            kwargs["prompts"] = [it.prompt for it in items]
        if "labels" in self._keywords:
            kwargs["labels"] = [it.label for it in items]
        if "images" in self._keywords:
            kwargs["images"] = [list(it.images) for it in items]
        responses = [it.response for it in items]
        references = [it.reference for it in items]
        try:
            values = list(await self._call(responses, references, **kwargs))
        except Exception as exc:
            err = BatchRewardError(f"batched reward function {self.name!r} raised {type(exc).__name__}: {exc}")
            return [err] * len(items)
        if len(values) != len(items):
            err = BatchRewardError(
                f"batched reward function {self.name!r} returned {len(values)} values for {len(items)} samples"
            )
            return [err] * len(items)
        out: list[float | Exception] = []
        for value in values:
            try:
                out.append(_as_float(value))
            except Exception as exc:
                out.append(exc)
        return out


    async def _score_adapted(self, items: Sequence[RewardItem]) -> list[Any]:
        """A foreign convention (streamrft.rewards.conventions): its adapter builds the arguments and
        reads the return value; a batched call that raises or returns a wrong shape fails its batch."""
        adapter = self.adapter
        if adapter.batched:
            try:
                args, kwargs = adapter.call(self.fn, items)
            except ConventionError as exc:  # a required argument these rows cannot give
                return [ConventionError(f"{self._where}: {exc}")] * len(items)
            try:
                result = await self._call(*args, **kwargs)
                return adapter.read(result, len(items), self._where)
            except Exception as exc:
                return [_convention_error(exc, self._where, BatchRewardError)] * len(items)

        async def one(item: RewardItem) -> Any:
            args, kwargs = adapter.call(self.fn, [item])
            try:
                return adapter.read_one(await self._call(*args, **kwargs), self._where)
            except Exception as exc:
                return _convention_error(exc, self._where, RuntimeError)

        if len(items) == 1:
            return [await one(items[0])]
        return list(await asyncio.gather(*(one(item) for item in items)))


def _convention_error(exc: Exception, where: str, kind: type[Exception]) -> Exception:
    if isinstance(exc, ConventionError):  # already names source, convention and what was wrong
        return exc
    return kind(f"{where} raised {type(exc).__name__}: {exc}")


def _as_float(value: Any) -> float:
    # bool counts as a number (True = 1.0): a pass/fail check is a common reward function.
    if not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"reward must be a number, got {type(value).__name__} {value!r}")
    return float(value)
