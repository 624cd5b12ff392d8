"""One way to time every call of a function the benchmarks watch (sync or async, a module function or a method on a
class): ``wrap_calls`` runs each call inside a context manager of the caller's."""

from __future__ import annotations

import functools
import inspect
from typing import Callable, ContextManager


def wrap_calls(owner, attr: str, around: Callable[[], ContextManager]) -> None:
    """Replace ``owner.attr`` by a version that runs each call inside ``around()``."""
    fn = getattr(owner, attr)

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapped_async(*a, **k):
            with around():
                return await fn(*a, **k)
        setattr(owner, attr, wrapped_async)
        return

    @functools.wraps(fn)
    def wrapped(*a, **k):
        with around():
            return fn(*a, **k)
    setattr(owner, attr, wrapped)
