"""The Qwen3 reasoning parser over HTTP with the official ``openai`` client: a server whose
engine has ``--reasoning-parser qwen3`` and the Hermes tool-call parser, the embedded model
forced (``ForceTokens`` through ``vllm_xargs``) to write a reply and then EOS. A
``<tool_call>`` with a function tag ends the reasoning without ``</think>``;
``chat_template_kwargs={"enable_thinking": false}`` makes the reply content; a call after
the reasoning reaches the tool parser as the content alone. Whole and streamed (the engine
streams one token per delta)."""

from __future__ import annotations

import json

from serving_support import MODEL, call, serving_fixtures

USER = [{"role": "user", "content": "What weather in Verona?"}]
PLAN = "Let me look at the sky."
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nVerona\n</parameter>\n"
            "</function>\n</tool_call>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


async_llm, app = serving_fixtures(
    engine={"reasoning_parser": "qwen3", "logits_processors": ["logits_processor_support:ForceTokens"]},
    enable_auto_tool_choice=True, tool_call_parser="hermes")


def forced(async_llm, text, **extra):
    """The reply ``text``, then EOS (finish_reason "stop")."""
    tok = async_llm.engine.tokenizer
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return {"vllm_xargs": {"force": ids}, **extra}


def both(app, body, **kw):
    """The reply whole, and streamed: (message, finish_reason, joined deltas)."""
    def create(api, stream):
        return api.chat.completions.create(model=MODEL, messages=USER, temperature=0,
                                           max_tokens=120, stream=stream, extra_body=body, **kw)
    whole = call(app, lambda api: create(api, False))

    async def chunks(api):
        return [ch async for ch in await create(api, True)]
    deltas = [c for ch in call(app, chunks) for c in ch.choices]
    joined = {name: "".join(getattr(c.delta, name, None) or "" for c in deltas)
              for name in ("reasoning", "reasoning_content", "content")}
    calls: dict[int, list[str]] = {}
    for c in deltas:
        for part in c.delta.tool_calls or []:
            entry = calls.setdefault(part.index, [part.function.name, ""])
            entry[1] += part.function.arguments or ""
    joined["tool_calls"] = [tuple(v) for _, v in sorted(calls.items())]
    joined["finish_reason"] = [c.finish_reason for c in deltas if c.finish_reason][-1]
    return whole.choices[0].message, whole.choices[0].finish_reason, joined


def test_a_tool_call_ends_the_reasoning(app, async_llm):
    message, reason, s = both(app, forced(async_llm, PLAN + XML_CALL))
    assert (message.reasoning, message.content) == (PLAN, XML_CALL)
    assert message.reasoning_content == PLAN and reason == "stop"
    assert (s["reasoning"], s["reasoning_content"], s["content"]) == (PLAN, PLAN, XML_CALL)
    # a <tool_call> the reasoning only mentions leaves it reasoning
    text = "Is <tool_call> a tag? Aye."
    message, _, s = both(app, forced(async_llm, text))
    assert (message.reasoning, message.content) == (text, None)
    assert (s["reasoning"], s["content"]) == (text, "")


def test_enable_thinking_false_makes_the_reply_content(app, async_llm):
    text = "It was the nightingale, and not the lark."
    off = forced(async_llm, text, chat_template_kwargs={"enable_thinking": False})
    message, _, s = both(app, off)
    assert message.content == text and getattr(message, "reasoning", None) is None
    assert (s["reasoning"], s["content"]) == ("", text)
    message, _, s = both(app, forced(async_llm, text))  # thinking on: the reply reasons
    assert (message.reasoning, message.content) == (text, None)
    assert (s["reasoning"], s["content"]) == (text, "")


def test_a_call_after_the_reasoning_reaches_the_tool_parser(app, async_llm):
    args = '{"city": "Verona"}'
    reply = f'<think>{PLAN}</think><tool_call>{{"name": "get_weather", "arguments": {args}}}'
    message, reason, s = both(app, forced(async_llm, reply), tools=TOOLS)  # unclosed: EOS
    assert message.reasoning == PLAN and not message.content and reason == "tool_calls"
    (tc,) = message.tool_calls
    assert (tc.function.name, json.loads(tc.function.arguments)) == ("get_weather",
                                                                     {"city": "Verona"})
    assert s["reasoning"] == PLAN and s["content"] == ""
    assert s["tool_calls"] == [("get_weather", args)] and s["finish_reason"] == "tool_calls"
