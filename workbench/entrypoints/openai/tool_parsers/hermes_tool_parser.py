"""The Hermes 2 Pro tool-call format (Qwen2.5 and Qwen3 use it too): each call is
``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>``; the text before the first
call is the content (vLLM's ``hermes`` parser; the tags may be split across any tokens).
The last call may lack its closing tag (the reply ended at EOS): a valid JSON object after
``<tool_call>`` is a call all the same, finished or streamed, as in vLLM.
"""

from __future__ import annotations

import json
from typing import Any

from workbench.entrypoints.openai.tool_parsers import json_prefix
from workbench.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    PrefixReading,
    ToolCallPrefix,
    ToolParser,
)
from workbench.entrypoints.openai.tool_parsers.registry import ToolParserManager
from workbench.utils.tags import held_back


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"

    def adjust_request(self, request: Any) -> Any:
        """The tags are special tokens in Hermes-style vocabularies: keep them in the text."""
        if request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    def parse_prefix(self, text: str) -> PrefixReading:
        start = text.find(self.tool_call_start_token)
        if start < 0:
            return PrefixReading(text[:len(text) - held_back(text, self.tool_call_start_token)])
        reading = PrefixReading(text[:start])
        while start >= 0:
            inner_start = start + len(self.tool_call_start_token)
            end = text.find(self.tool_call_end_token, inner_start)
            inner = text[inner_start:] if end < 0 else text[inner_start:end]
            reading.tool_calls.append(self._call(inner))
            if end < 0:
                break
            start = text.find(self.tool_call_start_token, end + len(self.tool_call_end_token))
        return reading

    @staticmethod
    def _call(inner: str) -> ToolCallPrefix:
        """One call's JSON object as far as it goes; complete once it is a valid object with
        a string ``name``, closed or not (vLLM reads an unclosed last call to the end of the
        reply; only a finished reply's reading asks whether a call is complete)."""
        i = json_prefix.skip_ws(inner, 0)
        members = {key: (s, e) for key, s, e in json_prefix.object_members(inner, i)}
        call = ToolCallPrefix()
        if "name" in members:
            call.name = json_prefix.complete_string(inner, members["name"])
        if "arguments" in members:
            s, e = members["arguments"]
            call.arguments = inner[s:e]
        try:
            obj = json.loads(inner)
        except ValueError:
            return call
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            call.complete = True
            call.arguments = call.arguments or "{}"
        return call
