"""The engine's exceptions (vLLM's ``vllm/v1/engine/exceptions.py``)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine stopped (shut down, a step raised, or its core process died): no request
    can be served any more."""
