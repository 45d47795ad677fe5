"""Tool-call parsers (vLLM's ``--tool-call-parser NAME``), registered by name."""

from workbench.entrypoints.openai.tool_parsers import hermes_tool_parser  # noqa: F401 (registers)
from workbench.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from workbench.entrypoints.openai.tool_parsers.registry import ToolParserManager

__all__ = ["ToolParser", "ToolParserManager"]
