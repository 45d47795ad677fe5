"""vLLM's ToolParser interface: ``extract_tool_calls`` reads a finished reply,
``extract_tool_calls_streaming`` is called on every delta of a streamed one.

A parser here describes what a *prefix* of the reply already says (:meth:`parse_prefix`:
the content so far and each tool call's name and arguments text so far); the streaming
method sends the difference from what it sent before. The prefix reading is monotone (a
longer prefix only extends what a shorter one said), so the deltas join into the whole
reply's reading however the text was split into tokens.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from workbench.entrypoints.openai.responses import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)


def make_tool_call_id() -> str:
    """vLLM's tool call id: ``chatcmpl-tool-`` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallPrefix:
    """One tool call as far as the text goes: its name once complete, its arguments' JSON
    text so far (complete once ``complete``)."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class PrefixReading:
    content: str = ""
    tool_calls: list[ToolCallPrefix] = field(default_factory=list)


@dataclass
class ExtractedToolCallInformation:
    """vLLM's result of ``extract_tool_calls``: ``content`` is the text beside the calls
    (None when there is none)."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None


class ToolParser:
    """Base of the tool parsers; one instance per choice (it keeps what it streamed).

    ``first_arguments``: what a call's first stream part carries as ``arguments`` when none
    are known yet (None: the field is left out, as vLLM's Hermes parser does; the readers of
    forced replies send ``""``, as vLLM's)."""

    first_arguments: str | None = None

    def __init__(self, tokenizer: Any = None) -> None:
        self.model_tokenizer = tokenizer
        # vLLM's streaming state names: the calls so far, and each one's arguments sent
        self.prev_tool_call_arr: list[dict[str, Any]] = []
        self.streamed_args_for_tool: list[str] = []
        self.current_tool_id = -1
        self._ids: list[str] = []
        self._content_sent = 0

    def adjust_request(self, request: Any) -> Any:
        """vLLM's hook to change a request before it runs (keep special tokens, say)."""
        return request

    def parse_prefix(self, text: str) -> PrefixReading:
        """What ``text``, a prefix of the reply, says so far (monotone, see the module)."""
        raise NotImplementedError

    def extract_tool_calls(self, model_output: str, request: Any = None
                           ) -> ExtractedToolCallInformation:
        """The finished reply's tool calls; a call left incomplete (or not valid JSON) means
        none were made, and the whole text is the content (vLLM's rule)."""
        reading = self.parse_prefix(model_output)
        calls = reading.tool_calls
        if not calls or not all(c.complete and c.name is not None for c in calls):
            return ExtractedToolCallInformation(False, [], model_output)
        return ExtractedToolCallInformation(
            True,
            [ToolCall(id=make_tool_call_id(), function=FunctionCall(name=c.name,
                                                                     arguments=c.arguments))
             for c in calls],
            reading.content or None,
        )

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str,
        previous_token_ids: Sequence[int] = (), current_token_ids: Sequence[int] = (),
        delta_token_ids: Sequence[int] = (), request: Any = None,
    ) -> DeltaMessage | None:
        """The chunk's new content and tool-call parts (None: nothing new to send): a call's
        first part carries its id, type and name (and the arguments so far), the later ones
        argument fragments; one part per call and chunk."""
        reading = self.parse_prefix(current_text)
        content = reading.content[self._content_sent:]
        self._content_sent = len(reading.content)
        deltas = []
        for index, call in enumerate(reading.tool_calls):
            if call.name is None:
                break  # names go first: nothing of a later call before this one's name
            new = index == len(self.prev_tool_call_arr)
            if new:
                self.current_tool_id = index
                self._ids.append(make_tool_call_id())
                self.prev_tool_call_arr.append({"name": call.name, "arguments": ""})
                self.streamed_args_for_tool.append("")
            fragment = call.arguments[len(self.streamed_args_for_tool[index]):]
            self.streamed_args_for_tool[index] = call.arguments
            self.prev_tool_call_arr[index]["arguments"] = call.arguments
            if new:
                deltas.append(DeltaToolCall(index=index, id=self._ids[index], type="function",
                                            function=DeltaFunctionCall(
                                                name=call.name,
                                                arguments=fragment or self.first_arguments)))
            elif fragment:
                deltas.append(DeltaToolCall(index=index,
                                            function=DeltaFunctionCall(arguments=fragment)))
        if not content and not deltas:
            return None
        return DeltaMessage(content=content or None, tool_calls=deltas or None)

    @property
    def tools_called(self) -> bool:
        """Whether the stream so far sent a tool call."""
        return bool(self.prev_tool_call_arr)
