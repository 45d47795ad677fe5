"""DeepSeek-R1's reasoning format, ``<think>...</think>`` (vLLM's ``deepseek_r1``): until
the end tag, all of the reply is reasoning (its template opens the tag in the prompt). A
finished reply's reasoning is a string even when empty (``"</think>x"``, ``""``: ``""``), as
vLLM's; the first ``<think>`` is dropped wherever it stands before the end tag (see
:mod:`workbench.reasoning.basic_parsers`)."""

from workbench.reasoning.abs_reasoning_parsers import ReasoningParserManager
from workbench.reasoning.basic_parsers import BaseThinkingReasoningParser


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    pass
