"""One chat choice's reply read as vLLM's serving_chat reads it: the reasoning parser first
(``--reasoning-parser``), then, on the content after the reasoning, the tool-call reader
``tool_choice`` asks for (a forced schema's reader, or the ``--tool-call-parser`` for
"auto"). The same reader serves a finished reply and a stream's deltas, so both agree.
"""

from __future__ import annotations

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
        self._sent = {"reasoning": "", "content": ""}  # what the stream sent of each

    @property
    def tools_called(self) -> bool:
        """Whether the stream sent a tool call."""
        return self.tools is not None and self.tools.tools_called

    def delta(self, current_text: str, delta_text: str) -> dict[str, Any]:
        """The stream delta's fields for this new text (``{}``: nothing to send yet)."""
        out = self._delta(current_text, delta_text)
        for name in self._sent:
            self._sent[name] += out.get(name, "")
        return out

    def flush(self, text: str, fields: dict[str, Any]) -> dict[str, Any]:
        """The last delta's ``fields`` completed with what the stream held back (a tag's
        possible beginning that never became the tag), so the stream's reasoning and content
        end as the finished reply's (content only when no tool call was sent)."""
        final, _ = self.message(text)
        fields = dict(fields)
        names = ["reasoning"] if self.tools_called else ["reasoning", "content"]
        for name in names:
            whole = final.get(name) or ""
            if name == "reasoning" and not self.include_reasoning:
                continue
            if whole.startswith(self._sent[name]) and len(whole) > len(self._sent[name]):
                rest = whole[len(self._sent[name]):]
                self._sent[name] = whole
                fields[name] = fields.get(name, "") + rest
                if name == "reasoning":
                    fields["reasoning_content"] = fields["reasoning"]
        return fields

    def _delta(self, current_text: str, delta_text: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        content = delta_text
        if self.reasoning is not None:
            part = self.reasoning.extract_reasoning_streaming(
                current_text[:len(current_text) - len(delta_text)], current_text, delta_text)
            content = (part.content if part else None) or ""
            if part and part.reasoning and self.include_reasoning:
                out["reasoning"] = out["reasoning_content"] = part.reasoning
        if self.tools is None:
            if content:
                out["content"] = content
            return out
        previous, self._content = self._content, self._content + content
        if content:
            message = self.tools.extract_tool_calls_streaming(previous, self._content, content)
            if message is not None and message.tool_calls and not self.parallel_tool_calls:
                message.tool_calls = [c for c in message.tool_calls if c.index == 0] or None
            if message is not None:
                out.update(message.model_dump(mode="json", exclude_none=True))
        return out

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
            if info.tools_called:
                calls, content = info.tool_calls, info.content
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
