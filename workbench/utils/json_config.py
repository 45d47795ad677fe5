"""A config dataclass from what a user passes for it: a dict, or its JSON text (a CLI flag's
form). Keys must be the dataclass's fields; anything else is a ValueError naming the option."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def config_from_json(cls: type[T], value: Any, name: str) -> T:
    """``cls(**value)`` for a dict or a JSON object string ``value``; ``name`` (the option, e.g.
    ``"speculative_config"``) starts every error: not a JSON object, or unknown keys (with
    the known ones listed). The fields' own checks are ``cls``'s."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} must be a JSON object, got {value!r} ({exc}).") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict or a JSON object, got {type(value).__name__}: {value!r}.")
    known = sorted(f.name for f in fields(cls))
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{name}: unknown keys {unknown}; known: {known}.")
    return cls(**value)
