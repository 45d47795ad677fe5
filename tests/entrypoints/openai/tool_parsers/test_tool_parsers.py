"""The tool-call parsers on hand-made replies: the Hermes format (content, several calls,
nested and escaped JSON, a call cut short, invalid JSON) and the readers of replies forced
by ``tool_choice``. Streamed, every split of the text into two deltas -- and one character
per delta -- reassembles into what the finished reply gives."""

from __future__ import annotations

import json

import pytest

from workbench.entrypoints.openai.tool_parsers import ToolParserManager
from workbench.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from workbench.entrypoints.openai.tool_parsers.json_prefix import array_items, object_members
from workbench.entrypoints.openai.tool_parsers.tool_choice_parsers import (
    NamedToolParser,
    RequiredToolParser,
    required_tools_schema,
)

TWO_CALLS = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
             '"Ver\\"ona", "tags": ["a}", {"deep": [1, 2.5e3, null, true]}]}}\n</tool_call>\n'
             '<tool_call>{"arguments": {}, "name": "ring_bell"}</tool_call>')


def stream(parser, text, cuts):
    """Feed ``text`` cut at ``cuts``; returns (content, [(id, name, arguments)])."""
    content, calls, bounds = "", {}, [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        delta = parser.extract_tool_calls_streaming(text[:a], text[:b], text[a:b])
        if delta is None:
            continue
        content += delta.content or ""
        for part in delta.tool_calls or []:
            if part.index not in calls:  # a call's first part names it
                assert part.id is not None and part.type == "function" and part.function.name
                calls[part.index] = [part.id, part.function.name, ""]
            else:
                assert part.id is None and part.function.name is None
            calls[part.index][2] += part.function.arguments or ""
    return content, [tuple(c) for _, c in sorted(calls.items())]


def finished(parser, text):
    info = parser.extract_tool_calls(text)
    return info.content, [(c.function.name, c.function.arguments) for c in info.tool_calls]


def test_hermes_is_registered_by_name():
    assert ToolParserManager.get_tool_parser("hermes") is Hermes2ProToolParser
    with pytest.raises(KeyError, match="invalid tool call parser: x"):
        ToolParserManager.get_tool_parser("x")


def test_hermes_finished_reply():
    content, calls = finished(Hermes2ProToolParser(), TWO_CALLS)
    assert content == "Let me look.\n"
    assert [name for name, _ in calls] == ["get_weather", "ring_bell"]
    assert json.loads(calls[0][1]) == {"city": 'Ver"ona', "tags": ["a}", {"deep": [1, 2500.0,
                                                                                  None, True]}]}
    assert calls[1][1] == "{}"
    ids = [c.id for c in Hermes2ProToolParser().extract_tool_calls(TWO_CALLS).tool_calls]
    assert all(i.startswith("chatcmpl-tool-") for i in ids) and len(set(ids)) == 2


@pytest.mark.parametrize("text", [
    "No call here, only <tool but not the tag.",
    'Cut: <tool_call>{"name": "get_weather", "arguments": {"city": "Ver',
    'Bad: <tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>',
])
def test_hermes_without_a_complete_call_the_text_is_the_content(text):
    assert finished(Hermes2ProToolParser(), text) == (text, [])


@pytest.mark.parametrize("text", [TWO_CALLS, "Plain words, and a < sign."])
def test_hermes_streamed_at_every_split_is_the_finished_reply(text):
    want_content, want_calls = finished(Hermes2ProToolParser(), text)
    if not want_calls:
        want_content = text
    for cut in range(len(text) + 1):
        content, calls = stream(Hermes2ProToolParser(), text, [cut])
        assert content == want_content[:len(content)]
        if want_calls:
            assert content == want_content
            assert [(n, a) for _, n, a in calls] == want_calls, cut
    content, calls = stream(Hermes2ProToolParser(), text, list(range(1, len(text))))
    assert [(n, a) for _, n, a in calls] == want_calls
    if want_calls:
        assert content == want_content


def test_hermes_holds_back_a_tag_until_it_is_certain():
    parser = Hermes2ProToolParser()
    assert parser.extract_tool_calls_streaming("", "Hi <tool", "Hi <tool").content == "Hi "
    delta = parser.extract_tool_calls_streaming("Hi <tool", "Hi <tool_call>", "_call>")
    assert delta is None  # the tag: nothing to send until the call is named


def test_name_goes_before_any_arguments():
    parser = Hermes2ProToolParser()
    text = '<tool_call>{"arguments": {"a": 1}, "name": "f'
    assert parser.extract_tool_calls_streaming("", text, text) is None
    delta = parser.extract_tool_calls_streaming(text, text + '"', '"')
    (part,) = delta.tool_calls
    assert (part.function.name, part.function.arguments) == ("f", '{"a": 1}')


def test_required_reader():
    text = '[{"name": "f", "parameters": {"x": [1, {"y": "]"}]}}, {"name": "g", "parameters": {}}]'
    assert finished(RequiredToolParser(), text) == (None, [("f", '{"x": [1, {"y": "]"}]}'),
                                                           ("g", "{}")])
    for cut in range(len(text) + 1):
        assert [(n, a) for _, n, a in stream(RequiredToolParser(), text, [cut])[1]] == [
            ("f", '{"x": [1, {"y": "]"}]}'), ("g", "{}")]


def test_named_reader():
    text = '{"city": "Verona", "days": 2}'
    assert finished(NamedToolParser("get_weather"), text) == (None, [("get_weather", text)])
    for cut in range(len(text) + 1):
        assert stream(NamedToolParser("get_weather"), text, [cut])[1][0][1:] == (
            "get_weather", text)


def test_required_schema_is_vllms():
    functions = [{"name": "f", "parameters": {"type": "object", "$defs": {"D": {"type": "string"}},
                                              "properties": {"d": {"$ref": "#/$defs/D"}}}},
                 {"name": "g"}]
    schema = required_tools_schema(functions)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema["$defs"] == {"D": {"type": "string"}}
    f, g = schema["items"]["anyOf"]
    assert f["properties"]["name"] == {"type": "string", "enum": ["f"]}
    assert "$defs" not in f["properties"]["parameters"] and f["required"] == ["name", "parameters"]
    assert g["properties"]["parameters"] == {"type": "object", "properties": {}}
    clash = [functions[0], {"name": "h", "parameters": {"$defs": {"D": {"type": "integer"}}}}]
    with pytest.raises(ValueError, match="Tool definition 'D' has multiple schemas"):
        required_tools_schema(clash)


def test_json_prefix_spans_never_move():
    text = '{"a": "x\\"}", "b": [1, {"c": 2}], "d": 12}'
    whole = object_members(text, 0)
    assert [(k, text[s:e]) for k, s, e in whole] == [("a", '"x\\"}"'), ("b", '[1, {"c": 2}]'),
                                                      ("d", "12")]
    for n in range(len(text)):
        for (k, s, e), (k2, s2, e2) in zip(object_members(text[:n], 0), whole):
            assert (k, s) == (k2, s2) and e in (None, e2)
    assert array_items("[1, [2, 3], 4", 0) == [(1, 2), (4, 10), (12, None)]
