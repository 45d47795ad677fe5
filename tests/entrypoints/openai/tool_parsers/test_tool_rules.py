"""vLLM's tool-parser rules, restated for the embedded tokenizer: Hermes' unclosed last call
(the reply ended at EOS), ``tool_choice="required"`` falling back to the server's tool-call
parser for a reply that is not a JSON array, and the ``arguments: ""`` of a forced call's
first stream part. Each reply is read finished and streamed through a ReplyReader, one token
per delta and in deltas cut anywhere (hypothesis): every split gives the same calls."""

from __future__ import annotations

import json

import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench import default_model_path
from workbench.entrypoints.openai.reply_parsing import ReplyReader
from workbench.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from workbench.entrypoints.openai.tool_parsers.tool_choice_parsers import (
    NamedToolParser,
    RequiredToolParser,
)

from reply_support import cuts, finished, stream

SPLITS = settings(max_examples=25, derandomize=True, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
ARGS = '{"city": "Verona", "days": 2}'
UNCLOSED = f'Good morrow.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n'
HERMES = UNCLOSED + '</tool_call>\n<tool_call>{"name": "ring_bell", "arguments": {}}</tool_call>'
ARRAY = (f'[{{"name": "get_weather", "parameters": {ARGS}}}, '
         '{"name": "ring_bell", "parameters": {}}]')


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(default_model_path())


def auto(tok):
    return ReplyReader(None, Hermes2ProToolParser(tok), tool_choice="auto")


def required(tok, fallback=True):
    return ReplyReader(None, RequiredToolParser(tok, Hermes2ProToolParser(tok) if fallback
                                                else None), tool_choice="required")


# -- rule 1: Hermes, a last call without its closing tag --------------------------------------

@pytest.mark.parametrize("text, calls", [
    (UNCLOSED, [("get_weather", ARGS)]),
    (UNCLOSED + '</tool_call><tool_call>{"name": "ring_bell", "arguments": {}}',
     [("get_weather", ARGS), ("ring_bell", "{}")]),
])
def test_hermes_unclosed_last_call_is_a_call(tok, text, calls):
    info = Hermes2ProToolParser(tok).extract_tool_calls(text)
    assert info.tools_called and info.content == "Good morrow.\n"
    assert [(c.function.name, c.function.arguments) for c in info.tool_calls] == calls
    fields, got = finished(auto(tok), text)
    assert got == calls and fields["content"] == "Good morrow.\n"
    s = stream(auto(tok), tok, text)
    assert s.tool_calls() == calls and s.content == "Good morrow.\n"
    assert auto(tok).finish_reason("stop", True) == "tool_calls"


@pytest.mark.parametrize("text", [
    'Good morrow.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ver',  # cut
    'Good morrow.\n<tool_call>\n{"name": "get_weather", "arguments": {}}</tool_',  # tag cut
    'Good morrow.\n<tool_call>\n{"name": "get_weather", "arguments": {}} and more',
])
def test_hermes_unclosed_call_that_is_not_json_is_no_call(tok, text):
    assert finished(auto(tok), text) == ({"content": text}, [])


@SPLITS
@given(data=st.data())
def test_hermes_unclosed_split_anywhere(tok, data):
    s = stream(auto(tok), tok, UNCLOSED, data.draw(cuts(tok, UNCLOSED)))
    assert s.tool_calls() == [("get_weather", ARGS)] and s.content == "Good morrow.\n"


# -- rule 7: "required" falls back to the server's tool-call parser ---------------------------

def test_required_reads_a_hermes_reply_with_the_servers_parser(tok):
    want = [("get_weather", ARGS), ("ring_bell", "{}")]
    fields, calls = finished(required(tok), HERMES)
    assert calls == want and fields["content"] == "Good morrow.\n"
    s = stream(required(tok), tok, HERMES)
    assert s.tool_calls() == want and s.content == "Good morrow.\n"
    assert required(tok).finish_reason("stop", True) == "tool_calls"
    # the JSON array is read as before, fallback or not
    for fallback in (True, False):
        assert finished(required(tok, fallback), ARRAY) == ({"content": None}, want)
        assert stream(required(tok, fallback), tok, ARRAY).tool_calls() == want
    # without a server parser, a reply that is not an array is no call: its text is content
    assert finished(required(tok, fallback=False), HERMES) == ({"content": HERMES}, [])
    s = stream(required(tok, fallback=False), tok, HERMES)
    assert s.tool_calls() == [] and s.content == HERMES
    # an array cut short is no call, and the fallback finds none in it either
    cut = ARRAY[:40]
    assert finished(required(tok), cut) == ({"content": cut}, [])
    assert finished(required(tok), " \n") == ({"content": None}, [])  # blank: no content


@SPLITS
@given(data=st.data())
def test_required_fallback_split_anywhere(tok, data):
    s = stream(required(tok), tok, HERMES, data.draw(cuts(tok, HERMES)))
    assert s.tool_calls() == [("get_weather", ARGS), ("ring_bell", "{}")]
    assert s.content == "Good morrow.\n"


# -- the note after rule 7: a forced call's first part carries arguments "" -------------------

def test_a_required_calls_first_part_has_empty_arguments(tok):
    s = stream(required(tok, fallback=False), tok, ARRAY)  # one token per delta
    assert [c["first"] for _, c in sorted(s.calls.items())] == [
        {"name": "get_weather", "arguments": ""}, {"name": "ring_bell", "arguments": ""}]
    # a delta that already holds arguments sends them with the name
    s = stream(required(tok, fallback=False), tok, ARRAY, [])
    assert s.calls[0]["first"] == {"name": "get_weather", "arguments": ARGS}
    parser = NamedToolParser("get_weather")
    delta = parser.extract_tool_calls_streaming("", " ", " ")
    assert delta.tool_calls[0].function.arguments == ""
    # Hermes (and "required" read by it) leaves the field out, as vLLM's Hermes parser does
    s = stream(required(tok), tok, HERMES)
    assert s.calls[0]["first"] == {"name": "get_weather"}
    assert stream(auto(tok), tok, HERMES).calls[0]["first"] == {"name": "get_weather"}


@SPLITS
@given(data=st.data())
def test_required_array_split_anywhere(tok, data):
    s = stream(required(tok), tok, ARRAY, data.draw(cuts(tok, ARRAY)))
    assert s.tool_calls() == [("get_weather", ARGS), ("ring_bell", "{}")]
    assert all(json.loads(args) is not None for _, args in s.tool_calls())
    assert all("arguments" in c["first"] for c in s.calls.values())
