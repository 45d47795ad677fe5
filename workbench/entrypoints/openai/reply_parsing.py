"""One chat choice's reply read as vLLM's serving_chat reads it: the reasoning parser first
(``--reasoning-parser``), then, on the content after the reasoning, the tool-call reader
``tool_choice`` asks for (a forced schema's reader, or the ``--tool-call-parser`` for
"auto"), which gets the content's text and token ids (vLLM's ``extract_content_ids``). The
same readers serve a finished reply and a stream's deltas, so both agree, except where
vLLM's finished-reply rules read a reply otherwise than its stream (the parsers say where);
at the stream's end :meth:`ReplyReader.flush` sends what the parsers held back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workbench.entrypoints.openai.responses import ToolCall
from workbench.entrypoints.openai.tool_parsers import ToolParser
from workbench.reasoning import ReasoningParser


class ReplyReader:
    """``reasoning``, ``tools``: this choice's parser instances (or None); ``tool_choice``:
    "auto", "required" or "named" (the finish reason depends on it); ``include_reasoning``
    False drops the reasoning from the reply; ``parallel_tool_calls`` False keeps only the
    first call."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, *,
                 tool_choice: str | None = None, include_reasoning: bool = True,
                 parallel_tool_calls: bool = True) -> None:
        self.reasoning, self.tools = reasoning, tools
        self.tool_choice, self.include_reasoning = tool_choice, include_reasoning
        self.parallel_tool_calls = parallel_tool_calls
        self._content = ""  # the content so far (what follows the reasoning)
        self._content_ids: list[int] = []  # its token ids (vLLM's extract_content_ids)
        self._reasoning_ended = False
        self._seen_ids = 0  # how many of the reply's token ids the stream has read
        self._sent = {"reasoning": "", "content": ""}  # what the stream sent of each

    @property
    def tools_called(self) -> bool:
        """Whether the stream sent a tool call."""
        return self.tools is not None and self.tools.tools_called

    def delta(self, current_text: str, delta_text: str, token_ids: Sequence[int] = ()
              ) -> dict[str, Any]:
        """The stream delta's fields for this new text (``{}``: nothing to send yet);
        ``token_ids``: the reply's ids so far (the delta's are those not seen before, so a
        delta whose text was empty hands its ids on to the next)."""
        token_ids = list(token_ids)
        delta_ids, self._seen_ids = token_ids[self._seen_ids:], len(token_ids)
        out = self._delta(current_text, delta_text, token_ids, delta_ids)
        self._count(out)
        return out

    def _count(self, out: dict[str, Any]) -> None:
        for name in self._sent:
            self._sent[name] += out.get(name, "")

    def flush(self, text: str, fields: dict[str, Any]) -> dict[str, Any]:
        """The last delta's ``fields`` completed with what the stream held back (a tag's
        possible beginning that never became the tag), so the stream's reasoning and content
        end as the whole reply's reading (content only when no tool call was sent)."""
        extra: dict[str, Any] = {}
        content = ""
        if self.reasoning is not None:
            part = self.reasoning.finish_streaming()
            if part is not None:
                if part.reasoning and self.include_reasoning:
                    extra["reasoning"] = extra["reasoning_content"] = part.reasoning
                content = part.content or ""
        if content:
            _merge(extra, self._content_delta(content, []))
        if self.tools is not None and not self.tools_called:
            whole = self.tools.extract_tool_calls(self._content).content or ""
            sent = self._sent["content"] + extra.get("content", "")
            if whole.startswith(sent) and len(whole) > len(sent):
                extra["content"] = extra.get("content", "") + whole[len(sent):]
        self._count(extra)
        return _merge(dict(fields), extra)

    def _delta(self, current_text: str, delta_text: str, token_ids: list[int],
               delta_ids: list[int]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        content, content_ids = delta_text, delta_ids
        if self.reasoning is not None:
            previous_ids = token_ids[:len(token_ids) - len(delta_ids)]
            part = self.reasoning.extract_reasoning_streaming(
                current_text[:len(current_text) - len(delta_text)], current_text, delta_text,
                previous_ids, token_ids, delta_ids)
            content = (part.content if part else None) or ""
            if part and part.reasoning and self.include_reasoning:
                out["reasoning"] = out["reasoning_content"] = part.reasoning
            if not self._reasoning_ended:
                content_ids = []
                if content:  # the reasoning ended here: the content's ids so far (vLLM)
                    self._reasoning_ended = True
                    if self.reasoning.model_tokenizer is not None and token_ids:
                        content_ids = self.reasoning.extract_content_ids(token_ids)
        return _merge(out, self._content_delta(content, content_ids))

    def _content_delta(self, content: str, content_ids: list[int]) -> dict[str, Any]:
        """The fields of new content (the tool parser reads it, with the content's token
        ids, when there is one)."""
        if self.tools is None:
            return {"content": content} if content else {}
        previous, self._content = self._content, self._content + content
        previous_ids, self._content_ids = self._content_ids, self._content_ids + content_ids
        if not content:
            return {}
        message = self.tools.extract_tool_calls_streaming(
            previous, self._content, content, previous_ids, self._content_ids, content_ids)
        if message is None:
            return {}
        if message.tool_calls and not self.parallel_tool_calls:
            message.tool_calls = [c for c in message.tool_calls if c.index == 0] or None
        return message.model_dump(mode="json", exclude_none=True)

    def message(self, text: str) -> tuple[dict[str, Any], list[ToolCall]]:
        """The finished reply's message fields and its tool calls."""
        fields: dict[str, Any] = {}
        content: str | None = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning(text)
            if reasoning is not None and self.include_reasoning:
                fields["reasoning"] = fields["reasoning_content"] = reasoning
        calls: list[ToolCall] = []
        if self.tools is not None and content is not None:
            info = self.tools.extract_tool_calls(content)
            calls, content = info.tool_calls, info.content  # no call: the parser's content
            calls = calls if self.parallel_tool_calls else calls[:1]
        fields["content"] = content
        return fields, calls

    def finish_reason(self, finish_reason: str | None, called: bool) -> str | None:
        """vLLM's rule: "tool_calls" when "auto" made calls, or "required" stopped after
        them (cut by ``length`` it keeps that); a named function keeps the engine's reason."""
        if called and (self.tool_choice == "auto" or (
                self.tool_choice == "required" and finish_reason == "stop")):
            return "tool_calls"
        return finish_reason


def _merge(fields: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with ``more``'s text appended and its tool-call parts added."""
    for name, value in more.items():
        if name == "tool_calls":
            fields[name] = fields.get(name, []) + value
        elif isinstance(value, str):
            fields[name] = fields.get(name, "") + value
        else:
            fields[name] = value
    return fields
