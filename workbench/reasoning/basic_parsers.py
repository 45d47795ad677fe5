"""vLLM's BaseThinkingReasoningParser: the reasoning sits between a start and an end tag
(``<think>``, ``</think>``). The start tag is optional, because many chat templates end the
prompt with it; everything after the end tag is content. Tags are text here, so they may be
split across any tokens (a tag's beginning is held back until it is certain).

The first start tag is taken out wherever it stands before the end tag. In a finished reply
vLLM drops what precedes it too (``"\\n<think>a</think>b"`` reasons ``"a"``); a stream can
do that only while what precedes it is blank (held back until the tag or other text comes),
so a start tag after reasoning already streamed just vanishes from the stream, as it does
from vLLM's.
"""

from __future__ import annotations

from collections.abc import Sequence

from workbench.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningReading
from workbench.utils.tags import held_back


class BaseThinkingReasoningParser(ReasoningParser):
    start_token = "<think>"
    end_token = "</think>"

    def read(self, text: str, final: bool = False) -> ReasoningReading:
        start, end = text.find(self.start_token), text.find(self.end_token)
        opened = start >= 0 and (end < 0 or start < end)
        if opened:
            lead = text[:start] if text[:start].strip() else ""
            body_at = start + len(self.start_token)
        else:
            if not final and end < 0 and self.start_token.startswith(text.lstrip()):
                return ReasoningReading()  # blank so far, or the start tag's beginning
            lead, body_at = "", 0
        body = text[body_at:]
        stop, content_at, hold = self._reasoning_end(body, final)
        if stop is None:
            if not final and not opened:
                hold = max(hold, held_back(body, self.start_token))
            return ReasoningReading(lead + body[:len(body) - (0 if final else hold)])
        return ReasoningReading(lead + body[:stop], body[content_at:], body_at + content_at)

    def _reasoning_end(self, body: str, final: bool) -> tuple[int | None, int, int]:
        """Where the reasoning in ``body`` (the text after a start tag) stops and its content
        starts; else ``(None, 0, hold)``, ``hold`` the characters at its end that may begin
        an end marker."""
        end = body.find(self.end_token)
        if end >= 0:
            return end, end + len(self.end_token), 0
        return None, 0, held_back(body, self.end_token)

    def extract_reasoning(self, model_output: str, request=None
                          ) -> tuple[str | None, str | None]:
        """vLLM's rule for a finished reply: the text after the first start tag (all of it
        without one) is reasoning up to the end tag, content after it; the reasoning is a
        string even when empty (``"</think>x"`` -> ``("", "x")``, ``""`` -> ``("", None)``),
        the content None when empty."""
        before, tag, after = model_output.partition(self.start_token)
        body = after if tag else before
        reasoning, tag, content = body.partition(self.end_token)
        return reasoning, (content or None) if tag else None

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
