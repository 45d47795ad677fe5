"""vLLM's ``collective_rpc`` with one worker: the worker is the engine's runner, and a call
returns one result per worker, so a list of one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def collective_rpc(runner, method: str | Callable, args: tuple = (),
                   kwargs: dict[str, Any] | None = None) -> list:
    """``[runner.method(*args, **kwargs)]``; a callable ``method`` gets the runner first (vLLM
    passes the worker as ``self``). AttributeError, naming it, for a method the runner lacks."""
    if isinstance(method, str):
        if method.startswith("_") or not callable(getattr(runner, method, None)):
            raise AttributeError(f"The worker ({type(runner).__name__}) has no public method "
                                 f"{method!r}.")
        return [getattr(runner, method)(*args, **(kwargs or {}))]
    return [method(runner, *args, **(kwargs or {}))]
