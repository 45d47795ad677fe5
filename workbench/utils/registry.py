"""NamedRegistry: classes registered by name with a decorator (vLLM's parser managers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar


class NamedRegistry:
    """Base of a registry of classes by name. A subclass says under which class attribute
    its dict lives and what its entries are called, ``class M(NamedRegistry,
    entries="tool_parsers", kind="tool call parser")``, and gets a dict of its own there:
    two registries never share entries. ``register_module(name)`` is the decorator;
    ``_lookup(name)`` raises KeyError ``"invalid <kind>: <name> (chose from { <known> })"``."""

    _entries: ClassVar[str]
    _kind: ClassVar[str]

    def __init_subclass__(cls, *, entries: str, kind: str, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._entries, cls._kind = entries, kind
        setattr(cls, entries, {})

    @classmethod
    def register_module(cls, name: str) -> Callable[[type], type]:
        """A decorator registering its class under ``name`` (a later one replaces it)."""
        def register(module: type) -> type:
            getattr(cls, cls._entries)[name] = module
            return module

        return register

    @classmethod
    def _lookup(cls, name: str) -> type:
        """The class registered as ``name``; KeyError naming the known ones otherwise."""
        known = getattr(cls, cls._entries)
        if name not in known:
            raise KeyError(f"invalid {cls._kind}: {name} (chose from "
                           f"{{ {','.join(sorted(known))} }})")
        return known[name]
