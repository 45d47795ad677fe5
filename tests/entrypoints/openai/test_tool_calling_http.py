"""Tool calling over HTTP with the official ``openai`` client: ``tool_choice`` named and
"required" (the reply forced by the tools' schemas: the same tokens as the offline engine
under that schema), "auto" with the Hermes parser (the embedded model forced to write a
``<tool_call>`` by a regex), "none", the 400s, and a history with tool calls and results
rendered as transformers renders it. Streams are reassembled by the client's own helper."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.openai.api_server import build_app
from workbench.entrypoints.openai.tool_parsers.tool_choice_parsers import required_tools_schema
from workbench.sampling_params import SamplingParams, StructuredOutputsParams

from serving_support import MODEL, call, hf, serving_fixtures  # noqa: F401 (fixture)

async_llm, app = serving_fixtures()
USER = [{"role": "user", "content": "What weather in Verona?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Verona", "Mantua"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 3}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The sky over a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ring_bell", "parameters": {
        "type": "object", "properties": {"times": {"type": "integer", "enum": [1, 2]}},
        "required": ["times"], "additionalProperties": False}}},
]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


@pytest.fixture(scope="module")
def auto_app(async_llm):
    return build_app(async_llm, model_name=MODEL, enable_auto_tool_choice=True,
                     tool_call_parser="hermes")


def offline(async_llm: AsyncLLM, messages, schema, max_tokens, tools=TOOLS) -> str:
    """The engine's greedy reply under ``schema`` to the conversation rendered with tools
    (the reference: the same constraint, built by hand, without the server)."""
    engine = async_llm.engine
    text = engine.input_processor.render_chat(messages, chat_template_kwargs={"tools": tools})
    params = SamplingParams(temperature=0, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(
                                json=schema, disable_any_whitespace=True))

    async def go():
        stream = await async_llm.add_request({"prompt": text}, params, "reference")
        last = None
        async for out in stream:
            last = out
        return last.outputs[0].text
    return asyncio.run(go())


def create(api, stream=False, **kw):
    return api.chat.completions.create(model=MODEL, messages=kw.pop("messages", USER),
                                       tools=kw.pop("tools", TOOLS), temperature=0,
                                       max_tokens=kw.pop("max_tokens", 40), stream=stream,
                                       extra_body=kw.pop("extra_body", COMPACT), **kw)


def test_named_tool_choice_forces_that_functions_arguments(app, async_llm):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = call(app, lambda api: create(api, tool_choice=choice))
    (tc,) = r.choices[0].message.tool_calls
    assert tc.type == "function" and tc.function.name == "get_weather"
    assert tc.id.startswith("chatcmpl-tool-") and len(tc.id) == len("chatcmpl-tool-") + 32
    jsonschema.validate(json.loads(tc.function.arguments), WEATHER)
    assert tc.function.arguments == offline(async_llm, USER, WEATHER, 40)
    assert r.choices[0].finish_reason == "stop"  # vLLM: a named function keeps the reason
    assert not r.choices[0].message.content

    async def streamed(api):
        async with api.chat.completions.stream(
                model=MODEL, messages=USER, tools=TOOLS, tool_choice=choice, temperature=0,
                max_tokens=40, extra_body=COMPACT) as stream:
            return await stream.get_final_completion()
    s = call(app, streamed)
    (stc,) = s.choices[0].message.tool_calls
    assert (stc.function.name, stc.function.arguments) == ("get_weather", tc.function.arguments)


ONE_CALL = {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60}


def test_required_tool_choice_is_an_array_of_calls(app, async_llm):
    r = call(app, lambda api: create(api, **ONE_CALL))
    schema = {**required_tools_schema([t["function"] for t in TOOLS]), "maxItems": 1}
    reference = json.loads(offline(async_llm, USER, schema, 60))
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (item["name"], item["parameters"]) for item in reference]
    assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"
    # parallel calls allowed: the model goes on calling until max_tokens cuts the array,
    # and a cut reply is no call: its text is the content, its reason "length"
    schema = required_tools_schema([t["function"] for t in TOOLS])
    r = call(app, lambda api: create(api, tool_choice="required", max_tokens=30))
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == offline(async_llm, USER, schema, 30)


def test_streamed_tool_call_deltas_name_first_then_arguments(app):
    chunks = call(app, lambda api: _chunks(api, **ONE_CALL))
    parts = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    first = {}
    for part in parts:  # each call's first part has its id, type and name; no later one does
        if part.index not in first:
            first[part.index] = part
            assert part.id.startswith("chatcmpl-tool-") and part.type == "function"
            assert part.function.name
        else:
            assert part.id is None and part.function.name is None and part.function.arguments
    whole = call(app, lambda api: create(api, **ONE_CALL))
    joined = ["".join(p.function.arguments or "" for p in parts if p.index == i) for i in first]
    assert joined == [c.function.arguments for c in whole.choices[0].message.tool_calls]
    assert [p.function.name for p in first.values()] == [
        c.function.name for c in whole.choices[0].message.tool_calls]
    assert [c.finish_reason for ch in chunks for c in ch.choices][-1] == "tool_calls"


async def _chunks(api, **kw):
    return [ch async for ch in await create(api, stream=True, **kw)]


HERMES_REPLY = ('Good morrow.\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Verona", "days": 2}}\n</tool_call>')


def _forced(text: str) -> dict:
    """structured_outputs forcing the embedded model to write exactly ``text``."""
    return {"structured_outputs": {"choice": [text]}}


def test_auto_tool_choice_with_the_hermes_parser(auto_app):
    r = call(auto_app, lambda api: create(api, tool_choice="auto", max_tokens=200,
                                          extra_body=_forced(HERMES_REPLY)))
    message = r.choices[0].message
    assert message.content == "Good morrow.\n" and r.choices[0].finish_reason == "tool_calls"
    (tc,) = message.tool_calls
    assert tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Verona", "days": 2}

    async def streamed(api):
        async with api.chat.completions.stream(
                model=MODEL, messages=USER, tools=TOOLS, temperature=0, max_tokens=200,
                extra_body=_forced(HERMES_REPLY)) as stream:  # no tool_choice: "auto"
            return await stream.get_final_completion()
    s = call(auto_app, streamed)
    assert s.choices[0].message.content == "Good morrow.\n"
    assert s.choices[0].finish_reason == "tool_calls"
    (stc,) = s.choices[0].message.tool_calls
    assert (stc.function.name, stc.function.arguments) == (tc.function.name, tc.function.arguments)


def test_an_unclosed_last_call_is_a_call(auto_app):
    """vLLM's Hermes rule: the reply ended (here: the forcing grammar ended it) after a
    complete JSON call and no ``</tool_call>``: still a call, whole and streamed."""
    reply = HERMES_REPLY[:-len("\n</tool_call>")]
    r = call(auto_app, lambda api: create(api, max_tokens=200, extra_body=_forced(reply)))
    message = r.choices[0].message
    assert message.content == "Good morrow.\n" and r.choices[0].finish_reason == "tool_calls"
    (tc,) = message.tool_calls
    assert (tc.function.name, json.loads(tc.function.arguments)) == (
        "get_weather", {"city": "Verona", "days": 2})
    chunks = call(auto_app, lambda api: _chunks(api, max_tokens=200, extra_body=_forced(reply)))
    parts = [p for ch in chunks for c in ch.choices for p in (c.delta.tool_calls or [])]
    assert parts[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in parts) == tc.function.arguments
    assert "".join(c.delta.content or "" for ch in chunks for c in ch.choices) == "Good morrow.\n"
    assert [c.finish_reason for ch in chunks for c in ch.choices][-1] == "tool_calls"


def test_required_with_the_servers_parser(auto_app, app):
    """With --tool-call-parser, "required" still reads the array its schema forces (the
    parser is the fallback for a reply that is not one: see the tool-parser tests), and
    a cut array is no call there either."""
    whole = call(app, lambda api: create(api, **ONE_CALL))
    r = call(auto_app, lambda api: create(api, **ONE_CALL))
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] \
        == [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert r.choices[0].finish_reason == "tool_calls"
    cut = call(auto_app, lambda api: create(api, tool_choice="required", max_tokens=30))
    assert not cut.choices[0].message.tool_calls and cut.choices[0].finish_reason == "length"
    assert cut.choices[0].message.content.startswith('[{"name": ')


def test_a_required_calls_first_delta_has_empty_arguments(app):
    """vLLM sends ``arguments: ""`` with the name when no argument text is known yet (the
    raw SSE, not the client's reassembly)."""
    from serving_support import client, sse_events

    async def go():
        async with client(app) as http:
            body = {"model": MODEL, "messages": USER, "tools": TOOLS, "temperature": 0,
                    "max_tokens": 60, "stream": True, "tool_choice": "required",
                    "parallel_tool_calls": False, **COMPACT}
            return sse_events((await http.post("/v1/chat/completions", json=body)).text)
    parts = [p for e in asyncio.run(go()) for c in e["choices"]
             for p in c["delta"].get("tool_calls", [])]
    assert parts[0]["function"] == {"name": parts[0]["function"]["name"], "arguments": ""}
    assert all("name" not in p["function"] and p["function"]["arguments"] for p in parts[1:])


def test_auto_without_a_tool_call_is_plain_content(auto_app):
    text = "Nay, I shall not."
    r = call(auto_app, lambda api: create(api, max_tokens=40, extra_body=_forced(text)))
    assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    chunks = call(auto_app, lambda api: _chunks(api, max_tokens=40, extra_body=_forced(text)))
    assert "".join(c.delta.content or "" for ch in chunks for c in ch.choices) == text


def test_tool_choice_none_renders_the_tools_and_calls_nothing(app, async_llm):
    r = call(app, lambda api: create(api, tool_choice="none", max_tokens=4,
                                     extra_body={"ignore_eos": True}))
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "length"
    text = async_llm.engine.input_processor.render_chat(USER, chat_template_kwargs={"tools": TOOLS})
    assert "- get_weather(city, days): The sky over a city.\n- ring_bell(times)\n" in text
    ids = async_llm.engine.tokenizer(text, add_special_tokens=False).input_ids
    assert r.usage.prompt_tokens == len(ids)

    async def tokenize():  # /tokenize renders the tools too (vLLM's)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as http:
            return (await http.post("/tokenize", json={"messages": USER, "tools": TOOLS})).json()
    assert asyncio.run(tokenize())["tokens"] == ids


def test_history_with_tool_calls_and_results_renders_as_transformers(app, hf):
    _, tok = hf
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Verona", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "Rain, and more rain."},
    ]
    r = call(app, lambda api: create(api, messages=history, tool_choice="none", max_tokens=2,
                                     extra_body={}))
    hf_history = [dict(m) for m in history]
    hf_history[1] = {**history[1], "content": "", "tool_calls": [{
        **history[1]["tool_calls"][0], "function": {"name": "get_weather",
                                                    "arguments": {"city": "Verona", "days": 1}}}]}
    text = tok.apply_chat_template(hf_history, tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Verona", "days": 1}}' in text
    assert "[A scroll answers: Rain, and more rain.]" in text
    assert r.usage.prompt_tokens == len(tok(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("kw, words", [
    ({"tool_choice": "auto"}, '"auto" tool choice requires --enable-auto-tool-choice and '
                              "--tool-call-parser to be set"),
    ({}, '"auto" tool choice requires'),  # tools without tool_choice mean "auto" (vLLM)
    ({"tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "does not match any of the specified `tools`"),
    ({"tool_choice": {"type": "function"}}, "Invalid value for `function`"),
    ({"tool_choice": "sometimes"}, "Invalid value for `tool_choice`: sometimes!"),
    ({"tools": []}, "`tools` must not be an empty array"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "extra_body": {"structured_outputs": {"regex": "a"}}},
     "You can only either use constraints or tools, not both."),
])
def test_tool_requests_vllm_refuses(app, kw, words):
    with pytest.raises(openai.BadRequestError) as info:
        call(app, lambda api: create(api, **kw))
    assert words in info.value.message
    assert info.value.body["param"] in ("tool_choice", "tools")


def test_auto_flag_needs_a_parser(async_llm):
    with pytest.raises(ValueError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        build_app(async_llm, model_name=MODEL, enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match=r"invalid tool call parser: nope \(chose from"):
        build_app(async_llm, model_name=MODEL, tool_call_parser="nope")


def test_the_serve_flags(capsys):
    from workbench.config import EngineArgs
    from workbench.entrypoints.cli import build_parser, main

    args = build_parser().parse_args([
        "serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--reasoning-parser", "qwen3", "--logits-processors", "a.b:C", "d.E"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.reasoning_parser == "qwen3"
    assert engine_args.logits_processors == ["a.b:C", "d.E"]
    assert main(["serve", "--enable-auto-tool-choice", "--num-kv-blocks", "8"]) == 2
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err
