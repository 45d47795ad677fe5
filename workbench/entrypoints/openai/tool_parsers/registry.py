"""vLLM's ToolParserManager: tool parsers by the name ``--tool-call-parser`` gives."""

from __future__ import annotations

from typing import ClassVar

from workbench.utils.registry import NamedRegistry


class ToolParserManager(NamedRegistry, entries="tool_parsers", kind="tool call parser"):
    tool_parsers: ClassVar[dict[str, type]]  # filled by register_module

    @classmethod
    def get_tool_parser(cls, name: str) -> type:
        """The parser class named ``name``; KeyError naming the known ones otherwise."""
        return cls._lookup(name)
