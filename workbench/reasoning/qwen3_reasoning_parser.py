"""Qwen3's reasoning format (vLLM's ``qwen3``): the same tags as DeepSeek-R1's; the
thinking models' templates open ``<think>`` in the prompt, so a reply without the start tag
is reasoning until ``</think>`` too. As vLLM's parser:

- a ``<tool_call>`` followed (after blanks) by ``<function=`` (or ``<function `` and a
  blank) also ends the reasoning, without ``</think>``: the content starts at the
  ``<tool_call>``, so the tool parser sees the whole call. A stream holds back such a
  ``<tool_call>`` (or the beginning of one) until the text after it says whether it is one;
- ``chat_template_kwargs={"enable_thinking": false}`` (the request's, passed to the
  constructor as vLLM passes them) makes the reply content: vLLM's templates then close the
  reasoning in the prompt, and its server sends every delta as content. Here the whole reply
  is content, finished or streamed (a ``</think>`` the model writes anyway stays in it).

Where vLLM reads a finished reply differently from its stream: it looks only at the first
``<tool_call>`` (a stream ends the reasoning at the first one followed by a function tag),
and a ``</think>`` anywhere wins over an earlier tool call; here ``extract_reasoning`` keeps
those rules, and a stream reads the first marker it meets.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from workbench.reasoning.abs_reasoning_parsers import ReasoningParserManager, ReasoningReading
from workbench.reasoning.basic_parsers import BaseThinkingReasoningParser
from workbench.utils.tags import held_back

_FUNCTION_OPEN = re.compile(r"<function[\s=]")
_FUNCTION = "<function"


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    tool_call_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        # Qwen3 thinks unless the request turns it off
        self.thinking_enabled = self.chat_template_kwargs.get("enable_thinking", True)

    def _genuine(self, after: str) -> bool | None:
        """Whether the text ``after`` a ``<tool_call>`` makes it a call that ends the
        reasoning: True, False, or None while it may still become one."""
        rest = after.lstrip()
        if _FUNCTION_OPEN.match(rest):
            return True
        return None if _FUNCTION.startswith(rest) else False

    def read(self, text: str, final: bool = False) -> ReasoningReading:
        if not self.thinking_enabled:
            return ReasoningReading("", text, 0)
        return super().read(text, final)

    def _reasoning_end(self, body: str, final: bool) -> tuple[int | None, int, int]:
        end = body.find(self.end_token)
        limit = end if end >= 0 else len(body)
        at = body.find(self.tool_call_token)
        while 0 <= at < limit:
            genuine = self._genuine(body[at + len(self.tool_call_token):])
            if genuine:
                return at, at, 0
            if genuine is None and not final:
                return None, 0, len(body) - at  # wait for what follows the tag
            at = body.find(self.tool_call_token, at + 1)
        if end >= 0:
            return end, end + len(self.end_token), 0
        if final:
            return None, 0, 0
        return None, 0, max(held_back(body, self.end_token),
                            held_back(body, self.tool_call_token))

    def extract_reasoning(self, model_output: str, request=None
                          ) -> tuple[str | None, str | None]:
        """vLLM's rule for a finished reply: the first ``<think>`` dropped (and what precedes
        it); split at ``</think>``; else, thinking off, all content; else at the first
        ``<tool_call>`` if a function tag follows it (empty parts None); else all
        reasoning."""
        if not self.thinking_enabled:
            return None, model_output
        before, tag, after = model_output.partition(self.start_token)
        body = after if tag else before
        if self.end_token in body:
            reasoning, _, content = body.partition(self.end_token)
            return reasoning, content or None
        at = body.find(self.tool_call_token)
        if at >= 0 and self._genuine(body[at + len(self.tool_call_token):]):
            return body[:at] or None, body[at:] or None
        return body, None

    def _tool_call_ends(self, text: str) -> list[int]:
        """Where in ``text`` a genuine ``<tool_call>`` with no ``</tool_call>`` after it
        stands (vLLM skips paired ones: a prompt's few-shot examples)."""
        found, at = [], text.find(self.tool_call_token)
        while at >= 0:
            rest = text[at + len(self.tool_call_token):]
            if self._genuine(rest) and self.tool_call_end_token not in rest:
                found.append(at)
            at = text.find(self.tool_call_token, at + 1)
        return found

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """vLLM's: the last of ``<think>``, ``</think>`` and an unpaired genuine
        ``<tool_call>`` in these tokens' text decides (none of them: not ended)."""
        text = self.model_tokenizer.decode(list(input_ids))
        ends = [text.rfind(self.end_token), *self._tool_call_ends(text)]
        return max(ends) >= 0 and max(ends) > text.rfind(self.start_token)

    def is_reasoning_end_streaming(self, input_ids: Sequence[int],
                                   delta_ids: Sequence[int]) -> bool:
        """The end tag, or a genuine ``<tool_call>``'s function tag, completes within
        ``delta_ids`` (a window of tokens as long as the longest marker is read)."""
        if super().is_reasoning_end_streaming(input_ids, delta_ids):
            return True
        ids = list(input_ids)
        window = ids[-(len(delta_ids) + len(self.tool_call_token) + 16):]
        text = self.model_tokenizer.decode(window)
        before = len(self.model_tokenizer.decode(window[:len(window) - len(delta_ids)]))
        pattern = re.escape(self.tool_call_token) + r"\s*<function[\s=]"
        return any(m.end() > before for m in re.finditer(pattern, text))
