"""The readers of a reply that ``tool_choice`` forced through structured outputs, as vLLM
builds them: ``"required"`` makes the reply a JSON array of ``{"name", "parameters"}``
objects (:func:`required_tools_schema`), a named function makes it that function's
arguments (its ``parameters`` schema). Both stream like any ToolParser; a call's first part
carries ``arguments: ""`` when none are known yet (vLLM's).

A "required" reply that is not a JSON array is read by the server's tool-call parser when
it has one (vLLM's fallback: a Hermes-formatted reply still yields its calls): a stream
decides by the reply's first character other than a blank, a finished reply by whether it
is a valid array of calls.
"""

from __future__ import annotations

import json
from typing import Any

from workbench.entrypoints.openai.tool_parsers import json_prefix
from workbench.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    PrefixReading,
    ToolCallPrefix,
    ToolParser,
)

#: A function declared without ``parameters`` takes none (vLLM's default schema).
NO_PARAMETERS = {"type": "object", "properties": {}}


def required_tools_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice: "required"``: at least one call, each naming one of
    ``functions`` (OpenAI function objects) with arguments that match its schema; the
    functions' ``$defs`` are merged at the top (ValueError if two differ under one name)."""
    defs: dict[str, Any] = {}
    variants = []
    for function in functions:
        params = dict(function.get("parameters") or NO_PARAMETERS)
        for name, schema in params.pop("$defs", {}).items():
            if defs.get(name, schema) != schema:
                raise ValueError(f"Tool definition '{name}' has multiple schemas, which is "
                                 "not supported.")
            defs[name] = schema
        variants.append({"properties": {"name": {"type": "string", "enum": [function["name"]]},
                                        "parameters": params},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": variants}}
    if defs:
        schema["$defs"] = defs
    return schema


class RequiredToolParser(ToolParser):
    """The reply is ``[{"name": ..., "parameters": {...}}, ...]``; each item is a call whose
    arguments are its ``parameters`` text. ``fallback``: the server's tool-call parser
    (``--enable-auto-tool-choice --tool-call-parser``), which reads a reply that is not an
    array."""

    first_arguments = ""

    def __init__(self, tokenizer: Any = None, fallback: ToolParser | None = None) -> None:
        super().__init__(tokenizer)
        self.fallback = fallback

    def _falls_back(self, text: str) -> bool:
        i = json_prefix.skip_ws(text, 0)
        return self.fallback is not None and i < len(text) and text[i] != "["

    def parse_prefix(self, text: str) -> PrefixReading:
        if self._falls_back(text):
            self.first_arguments = self.fallback.first_arguments
            return self.fallback.parse_prefix(text)
        reading = PrefixReading()
        for start, end in json_prefix.array_items(text, json_prefix.skip_ws(text, 0)):
            members = {k: (s, e) for k, s, e in json_prefix.object_members(text, start)}
            call = ToolCallPrefix()
            if "name" in members:
                call.name = json_prefix.complete_string(text, members["name"])
            if "parameters" in members:
                s, e = members["parameters"]
                call.arguments = text[s:e if e is not None else (end or len(text))]
            call.complete = end is not None and call.name is not None
            reading.tool_calls.append(call)
        return reading

    def extract_tool_calls(self, model_output: str, request: Any = None
                           ) -> ExtractedToolCallInformation:
        """The array's calls; a reply that is not a valid array of calls goes to the
        fallback parser when there is one (no call there and a blank reply: no content,
        as vLLM's)."""
        if self.fallback is not None and not _is_call_array(model_output):
            info = self.fallback.extract_tool_calls(model_output, request)
            if not info.tools_called and not model_output.strip():
                info.content = None
            return info
        return super().extract_tool_calls(model_output, request)


def _is_call_array(text: str) -> bool:
    """vLLM's test of a "required" reply: a JSON array of objects, each with a string
    ``name`` (and ``parameters``, an object, when present)."""
    try:
        items = json.loads(text)
    except ValueError:
        return False
    return isinstance(items, list) and all(
        isinstance(item, dict) and isinstance(item.get("name"), str)
        and isinstance(item.get("parameters", {}), dict | None) for item in items)


class NamedToolParser(ToolParser):
    """The reply is the arguments of the one function ``name``."""

    first_arguments = ""

    def __init__(self, name: str, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self.name = name

    def parse_prefix(self, text: str) -> PrefixReading:
        start = json_prefix.skip_ws(text, 0)
        arguments = text[start:]
        try:
            json.loads(arguments)
            complete = True
        except ValueError:
            complete = False
        return PrefixReading("", [ToolCallPrefix(self.name, arguments, complete)])
