"""A callable wrapped in a profiler range: what ``torch.profiler`` shows of the engine's stages."""

from __future__ import annotations

import torch


class Ranged:
    """Calls ``target`` inside a ``record_function(name)``; other attributes are the target's."""

    def __init__(self, target, name: str) -> None:
        self._target, self._name = target, name

    def __call__(self, *args, **kwargs):
        with torch.profiler.record_function(self._name):
            return self._target(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self._target, attr)
