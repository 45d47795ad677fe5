"""Structured outputs over HTTP with the official ``openai`` client on the ASGI app:
``chat.completions.parse`` with a pydantic model, ``response_format`` json_object /
json_schema (streamed too), ``structured_outputs`` and the older ``guided_*`` fields.
Outputs are checked by the client's own parsing, ``jsonschema`` and ``re.fullmatch``."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import jsonschema
import openai
import pydantic

from serving_support import MODEL, call, serving_fixtures

async_llm, app = serving_fixtures()
USER = [{"role": "user", "content": "Who speaks, and how many lines?"}]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # the model loves newlines


class Line(pydantic.BaseModel):
    speaker: Literal["ROMEO", "JULIET", "NURSE"]
    mood: Literal["glad", "sad"]
    lines: int = pydantic.Field(ge=0, le=20)
    aside: bool


def test_parse_with_a_pydantic_model(app):
    async def go(api):
        return await asyncio.gather(*(api.chat.completions.parse(
            model=MODEL, messages=USER, response_format=Line, max_completion_tokens=80,
            temperature=t, seed=7, extra_body=COMPACT) for t in (0, 1.0)))

    for completion in call(app, go):
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Line)
        jsonschema.validate(json.loads(choice.message.content), Line.model_json_schema())


def test_json_object_and_streamed_json_schema(app):
    schema = {"type": "object", "properties": {"word": {"enum": ["ay", "nay"]}},
              "required": ["word"]}

    async def go(api):
        obj = await api.chat.completions.create(
            model=MODEL, messages=USER, response_format={"type": "json_object"},
            max_completion_tokens=120, temperature=0, extra_body=COMPACT)
        stream = await api.chat.completions.create(
            model=MODEL, messages=USER, max_completion_tokens=40, temperature=0, stream=True,
            extra_body=COMPACT, response_format={"type": "json_schema",
                             "json_schema": {"name": "w", "schema": schema, "strict": True}})
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return obj, text

    obj, text = call(app, go)
    content = obj.choices[0].message.content
    if obj.choices[0].finish_reason == "stop":  # any keys: the model may still write one
        assert isinstance(json.loads(content), dict)
    else:
        assert content.startswith("{")
    jsonschema.validate(json.loads(text), schema)


def test_structured_outputs_and_the_older_guided_fields(app):
    async def go(api):
        return await asyncio.gather(
            api.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=20, n=2,
                                   temperature=1.0, seed=1,
                                   extra_body={"structured_outputs": {"choice": ["ay", "nay"]}}),
            api.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=20, temperature=0,
                                   extra_body={"guided_regex": r"Act [IVX]{1,3}\."}),
            api.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=20,
                                        temperature=0, extra_body={"guided_choice": ["yes"]}),
            api.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=20, temperature=0,
                                   extra_body={"structured_outputs": {
                                       "grammar": 'root ::= "O " ("Romeo" | "Juliet") "!"'}}),
        )

    choice, regex, chat, grammar = call(app, go)
    assert [c.text in ("ay", "nay") for c in choice.choices] == [True, True]
    assert re.fullmatch(r"Act [IVX]{1,3}\.", regex.choices[0].text)
    assert chat.choices[0].message.content == "yes"
    assert re.fullmatch(r"O (Romeo|Juliet)!", grammar.choices[0].text)


def test_a_bad_schema_is_a_400_naming_the_field_and_the_next_request_is_served(app):
    async def go(api):
        try:
            await api.chat.completions.create(
                model=MODEL, messages=USER, max_completion_tokens=5,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "x", "schema": {"type": "object", "minProperties": "two"}}})
        except openai.BadRequestError as exc:
            error = exc.body
        ok = await api.chat.completions.create(model=MODEL, messages=USER,
                                               max_completion_tokens=3)
        return error, ok

    error, ok = call(app, go)
    assert error["param"] == "response_format"
    assert error["message"].startswith("response_format: ")
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_structural_tags_lark_and_whitespace_patterns(app):
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<verdict>"},
        {"type": "regex", "pattern": "(Ay|Nay), my lord"},
        {"type": "const_string", "value": "</verdict>"}]}}
    legacy = {"structures": [{"begin": "<f=x>", "schema": {"type": "boolean"}, "end": "</f>"}],
              "triggers": ["<f="]}
    schema = {"type": "object", "properties": {"ay": {"type": "boolean"}}, "required": ["ay"],
              "additionalProperties": False}

    async def go(api):
        return await asyncio.gather(
            api.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=20,
                                        temperature=0, response_format=tag),
            api.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=20, temperature=0,
                                   extra_body={"structural_tag": json.dumps(legacy)}),
            api.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=20, temperature=0,
                                   extra_body={"structured_outputs": {
                                       "grammar": 'start: "O " name "!"\nname: "Romeo" | "Juliet"'}}),
            api.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=30, temperature=1.0,
                                   seed=1, extra_body={"structured_outputs": {
                                       "json": schema, "whitespace_pattern": "[ ]?"}}))

    tagged, triggered, lark, spaced = call(app, go)
    assert re.fullmatch(r"<verdict>(Ay|Nay), my lord</verdict>", tagged.choices[0].message.content)
    for body in re.findall(r"<f=x>(.*?)</f>", triggered.choices[0].text):
        assert json.loads(body) in (True, False)
    assert lark.choices[0].text in ("O Romeo!", "O Juliet!")
    assert spaced.choices[0].finish_reason == "stop"
    assert re.fullmatch(r'\{ ?"ay" ?: ?(true|false) ?\}', spaced.choices[0].text)
