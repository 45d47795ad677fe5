"""Loading ``--logits-processors``: each entry a LogitsProcessor subclass or its fully
qualified name, ``package.module:Class`` or ``package.module.Class`` (vLLM's two spellings)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from workbench.worker.logits_processor.interface import LogitsProcessor


def load_logits_processors(names: Sequence[str | type]) -> list[type[LogitsProcessor]]:
    """The classes, imported; ValueError naming the entry that is not a LogitsProcessor."""
    classes = []
    for entry in names:
        cls = entry
        if isinstance(entry, str):
            module, sep, qualname = entry.partition(":")
            if not sep:
                module, _, qualname = entry.rpartition(".")
            try:
                cls = importlib.import_module(module)
                for part in qualname.split("."):
                    cls = getattr(cls, part)
            except (ImportError, AttributeError, ValueError) as exc:
                raise ValueError(f"logits_processors: cannot load {entry!r}: {exc}") from None
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(f"logits_processors: {entry!r} is not a subclass of "
                             "workbench.worker.logits_processor.LogitsProcessor.")
        classes.append(cls)
    return classes
