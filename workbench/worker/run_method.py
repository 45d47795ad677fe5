"""vLLM's ``run_method``: what a worker runs for ``collective_rpc``. Here the worker is the
engine's runner (one worker), so ``collective_rpc`` returns a list of one result."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def run_method(worker, method: str | Callable, args: tuple = (),
               kwargs: dict[str, Any] | None = None) -> Any:
    """``worker.method(*args, **kwargs)``; a callable ``method`` gets the worker first (vLLM
    passes it as ``self``). AttributeError, naming it, for a method the worker lacks."""
    if isinstance(method, str):
        if method.startswith("_") or not callable(getattr(worker, method, None)):
            raise AttributeError(f"The worker ({type(worker).__name__}) has no public method "
                                 f"{method!r}.")
        return getattr(worker, method)(*args, **(kwargs or {}))
    return method(worker, *args, **(kwargs or {}))
