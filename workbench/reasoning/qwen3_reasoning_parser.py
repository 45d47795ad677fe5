"""Qwen3's reasoning format (vLLM's ``qwen3``): the same tags as DeepSeek-R1's; the
thinking models' templates open ``<think>`` in the prompt, so a reply without the start tag
is reasoning until ``</think>`` too."""

from workbench.reasoning.abs_reasoning_parsers import ReasoningParserManager
from workbench.reasoning.basic_parsers import BaseThinkingReasoningParser


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    pass
