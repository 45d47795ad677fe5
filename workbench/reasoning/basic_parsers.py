"""vLLM's BaseThinkingReasoningParser: the reasoning sits between a start and an end tag
(``<think>``, ``</think>``). The start tag is optional, because many chat templates end the
prompt with it; everything after the end tag is content. Tags are text here, so they may be
split across any tokens (a tag's beginning is held back until it is certain)."""

from __future__ import annotations

from collections.abc import Sequence

from workbench.reasoning.abs_reasoning_parsers import ReasoningParser
from workbench.utils.tags import held_back


class BaseThinkingReasoningParser(ReasoningParser):
    start_token = "<think>"
    end_token = "</think>"

    def parse_prefix(self, text: str, final: bool = False) -> tuple[str, str]:
        if not final and self.start_token.startswith(text):
            return "", ""  # maybe the start tag, not complete yet
        if text.startswith(self.start_token):
            text = text[len(self.start_token):]
        end = text.find(self.end_token)
        if end < 0:
            return text[:len(text) - (0 if final else held_back(text, self.end_token))], ""
        return text[:end], text[end + len(self.end_token):]

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether these tokens' text has an end tag after its last start tag."""
        text = self.model_tokenizer.decode(list(input_ids))
        end = text.rfind(self.end_token)
        return end >= 0 and end > text.rfind(self.start_token)

    def is_reasoning_end_streaming(self, input_ids: Sequence[int],
                                   delta_ids: Sequence[int]) -> bool:
        """Whether the end tag completes within ``delta_ids``, the last of ``input_ids``:
        only a window as long as the tag (in tokens, each at least a character) is read."""
        window = len(delta_ids) + len(self.end_token)
        text = self.model_tokenizer.decode(list(input_ids[-window:]))
        return self.end_token in text
