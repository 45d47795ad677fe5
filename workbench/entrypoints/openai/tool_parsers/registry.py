"""vLLM's ToolParserManager: tool parsers by the name ``--tool-call-parser`` gives."""

from __future__ import annotations

from collections.abc import Callable


class ToolParserManager:
    tool_parsers: dict[str, type] = {}

    @classmethod
    def register_module(cls, name: str) -> Callable[[type], type]:
        def register(parser: type) -> type:
            cls.tool_parsers[name] = parser
            return parser

        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type:
        """The parser class named ``name``; KeyError naming the known ones otherwise."""
        if name not in cls.tool_parsers:
            raise KeyError(f"invalid tool call parser: {name} (chose from "
                           f"{{ {','.join(sorted(cls.tool_parsers))} }})")
        return cls.tool_parsers[name]
