"""Reasoning over HTTP with the official ``openai`` client: a server whose engine has the
``deepseek_r1`` reasoning parser and the ``ForceTokens`` logits processor (loaded by name,
driven per request through ``vllm_xargs``), which makes the embedded model think aloud in
``<think>`` tags. ``reasoning`` / ``reasoning_content`` and ``content``, whole and streamed;
structured outputs and a forced tool call that start after the reasoning; reasoning_effort
reaching the template."""

from __future__ import annotations

import json
import re

import openai
import pytest
from logits_processor_support import force_args
from serving_support import MODEL, call, serving_fixtures

USER = [{"role": "user", "content": "Wilt thou be gone?"}]
THINK, ANSWER = "Is it the lark?", "It was the nightingale."


async_llm, app = serving_fixtures(
    engine={"reasoning_parser": "deepseek_r1", "logits_processors": ["logits_processor_support:ForceTokens"]})


def forced(async_llm, text, **extra):
    return {"vllm_xargs": force_args(async_llm.engine.tokenizer, text), **extra}


def create(api, extra_body, stream=False, **kw):
    return api.chat.completions.create(model=MODEL, messages=USER, temperature=0,
                                       max_tokens=kw.pop("max_tokens", 40), stream=stream,
                                       extra_body=extra_body, **kw)


def test_reasoning_and_content_whole_and_streamed(app, async_llm):
    body = forced(async_llm, f"<think>{THINK}</think>{ANSWER}")
    r = call(app, lambda api: create(api, body))
    message = r.choices[0].message
    assert message.reasoning_content == message.reasoning == THINK
    assert message.content.startswith(ANSWER) and "<think>" not in message.content

    async def chunks(api):
        return [ch async for ch in await create(api, body, stream=True)]
    deltas = [c.delta for ch in call(app, chunks) for c in ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THINK
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == THINK
    assert "".join(d.content or "" for d in deltas) == message.content
    # the reasoning goes out before any content
    kinds = ["r" if getattr(d, "reasoning_content", None) else "c" for d in deltas
             if getattr(d, "reasoning_content", None) or d.content]
    assert kinds == sorted(kinds, reverse=True)

    r = call(app, lambda api: create(api, {**body, "include_reasoning": False}))
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    assert r.choices[0].message.content == message.content


def test_unfinished_reasoning_is_all_reasoning(app, async_llm):
    r = call(app, lambda api: create(api, forced(async_llm, "<think>Stay"), max_tokens=6))
    message = r.choices[0].message
    assert message.reasoning_content.startswith("Stay") and not message.content
    assert r.choices[0].finish_reason == "length"


def test_structured_outputs_start_after_the_reasoning(app, async_llm):
    regex = "(ay|nay), (sweet|good) (lady|lord)"
    body = forced(async_llm, "<think>Shall I speak?</think>",
                  structured_outputs={"regex": regex})
    r = call(app, lambda api: create(api, body))
    choice = r.choices[0]
    assert choice.message.reasoning_content == "Shall I speak?"
    assert re.fullmatch(regex, choice.message.content) and choice.finish_reason == "stop"


def test_a_forced_tool_call_after_the_reasoning(app, async_llm):
    tools = [{"type": "function", "function": {"name": "part", "parameters": {
        "type": "object", "properties": {"sorrow": {"type": "string", "enum": ["sweet"]}},
        "required": ["sorrow"], "additionalProperties": False}}}]
    body = forced(async_llm, "<think>Parting is such</think>",
                  structured_outputs={"disable_any_whitespace": True})
    r = call(app, lambda api: create(api, body, tools=tools, tool_choice={
        "type": "function", "function": {"name": "part"}}))
    message = r.choices[0].message
    assert message.reasoning_content == "Parting is such", message
    (tc,) = message.tool_calls
    assert tc.function.name == "part" and json.loads(tc.function.arguments) == {"sorrow": "sweet"}


def test_a_processors_validate_params_answers_400(app):
    with pytest.raises(openai.BadRequestError) as info:
        call(app, lambda api: create(api, {"vllm_xargs": {"force": "lark"}}))
    assert "extra_args.force must be a list of token ids" in info.value.message


def test_reasoning_effort_reaches_the_template(app, async_llm):
    template = "{{ reasoning_effort or 'unset' }}:{{ messages[0]['content'] }}"
    tok = async_llm.engine.tokenizer
    for effort, words in [("high", "high"), (None, "unset")]:
        r = call(app, lambda api: create(api, {"chat_template": template}, max_tokens=1,
                                         reasoning_effort=effort))
        expected = tok(f"{words}:{USER[0]['content']}", add_special_tokens=False).input_ids
        assert r.usage.prompt_tokens == len(expected)


def both(app, body):
    """The reply whole, and its stream's deltas joined: (message, reasoning, content)."""
    whole = call(app, lambda api: create(api, body))

    async def chunks(api):
        return [ch async for ch in await create(api, body, stream=True)]
    deltas = [c.delta for ch in call(app, chunks) for c in ch.choices]
    return (whole.choices[0].message,
            "".join(getattr(d, "reasoning", None) or "" for d in deltas),
            "".join(d.content or "" for d in deltas))


def test_empty_reasoning_is_an_empty_string(app, async_llm):
    """vLLM's rule: a reply with nothing before ``</think>`` reasons ``""`` (not None)."""
    message, reasoning, content = both(app, forced(async_llm, f"</think>{ANSWER}"))
    assert message.reasoning == message.reasoning_content == ""
    assert message.content.startswith(ANSWER)
    assert (reasoning, content) == ("", message.content)  # nothing to stream for ""


def test_the_first_think_tag_after_a_newline_is_dropped(app, async_llm):
    message, reasoning, content = both(app, forced(async_llm, f"\n<think>{THINK}</think>{ANSWER}"))
    assert message.reasoning == THINK and message.content.startswith(ANSWER)
    assert (reasoning, content) == (THINK, message.content)
