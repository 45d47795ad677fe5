"""DeepSeek-R1's reasoning format, ``<think>...</think>`` (vLLM's ``deepseek_r1``): until
the end tag, all of the reply is reasoning (its template opens the tag in the prompt)."""

from workbench.reasoning.abs_reasoning_parsers import ReasoningParserManager
from workbench.reasoning.basic_parsers import BaseThinkingReasoningParser


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    pass
