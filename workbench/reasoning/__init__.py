"""Reasoning parsers (vLLM's ``--reasoning-parser NAME``): they split a reply into its
reasoning and its content; the structured-output manager asks them when reasoning ends."""

from workbench.reasoning import deepseek_r1_reasoning_parser  # noqa: F401 (registers)
from workbench.reasoning import qwen3_reasoning_parser  # noqa: F401 (registers)
from workbench.reasoning.abs_reasoning_parsers import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningParserManager,
)

__all__ = ["ReasoningDelta", "ReasoningParser", "ReasoningParserManager"]
