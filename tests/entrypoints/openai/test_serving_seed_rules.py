"""The server where it used to differ from its vLLM seeds (issue 30, part 3, items 8-15 and
17), each checked against the rule it follows: the seed's, or vLLM V1's where V1 itself now
does otherwise. Client-visible rules go through the official ``openai`` client; texts are
checked against transformers' greedy tokens, and every test ends with all KV blocks free."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import openai
import pytest

from workbench import LLMEngine, SamplingParams
from workbench.core.request_events import RequestFinished
from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.openai import chat as chat_module
from workbench.entrypoints.openai.api_server import build_app
from workbench.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

from serving_support import (  # noqa: F401 (hf: a fixture)
    MODEL, call, client, drive_asgi, greedy_ids, hf, sse_events, wait_all_free,
)

CTX, BLOCKS = 160, 64
USER = [{"role": "user", "content": "Good morrow, sweet lady."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def async_llm():
    llm = AsyncLLM(LLMEngine(device="cpu", block_size=8, num_kv_blocks=BLOCKS,
                             max_model_len=CTX))
    yield llm
    asyncio.run(llm.shutdown())


@pytest.fixture(scope="module")
def app(async_llm):
    # a tool-call parser without --enable-auto-tool-choice: adjust_request must still run
    return build_app(async_llm, model_name=MODEL, tool_call_parser="hermes")


@pytest.fixture(autouse=True)
def blocks_freed(async_llm):
    yield
    asyncio.run(wait_all_free(async_llm, num_blocks=BLOCKS))


def chat_prompt_ids(tok, messages=USER, **kwargs) -> list[int]:
    """The chat prompt as transformers renders and tokenizes it (the server's reference)."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tok(text, add_special_tokens=False).input_ids


def engine_ids(async_llm) -> list[str]:
    """Every request id the engine scheduled as new, in order (from its StepRecords)."""
    return asyncio.run(async_llm.call(lambda: [
        rid for r in async_llm.engine.history for rid in r.scheduler_output.new_request_ids]))


# ---------------------------------------------------------------- 8: the error body
def test_error_body_is_v1s_error_response(app):
    """vLLM V1's ErrorResponse is ``{"error": ErrorInfo}``: no top-level "object"; the client
    maps it to its exception class and reads type, param and code from it."""
    async def go(api):
        with pytest.raises(openai.NotFoundError) as missing:
            await api.completions.create(model="nobody", prompt="ROMEO:", max_tokens=1)
        with pytest.raises(openai.BadRequestError) as bad:
            await api.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=1, n=0)
        return missing.value, bad.value

    missing, bad = call(app, go)
    for err, status in ((missing, 404), (bad, 400)):
        raw = err.response.json()
        assert set(raw) == {"error"}, raw
        assert set(raw["error"]) == {"message", "type", "param", "code"}
        assert raw["error"]["code"] == status == err.status_code
    assert missing.type == "NotFoundError" and missing.param == "model"
    assert missing.body["message"] == "The model `nobody` does not exist."
    assert bad.type == "BadRequestError" and bad.param == "n"


# ---------------------------------------------------------------- 9: truncate_prompt_tokens
def test_truncate_minus_one_keeps_the_context_less_max_tokens(app, hf):
    """V1's TokenizeParams: -1 keeps max_model_len - max_tokens tokens (the last ones), and
    the request then runs; the text is transformers' greedy continuation of those tokens."""
    model, tok = hf
    ids = tok("ROMEO:\n" + "But soft, what light through yonder window breaks? " * 20).input_ids
    assert len(ids) > CTX
    kept = ids[-(CTX - 5):]

    async def go(api):
        return await api.completions.create(
            model=MODEL, prompt=ids, max_tokens=5, temperature=0,
            extra_body={"truncate_prompt_tokens": -1, "ignore_eos": True})

    c = call(app, go)
    assert c.usage.prompt_tokens == CTX - 5 and c.usage.completion_tokens == 5
    assert c.choices[0].text == tok.decode(greedy_ids(model, kept, 5), skip_special_tokens=True)


def test_truncate_limits_are_v1s(app, hf):
    """k above max_model_len - max_tokens: V1's 400 naming the field; -1 on a chat with no
    max_tokens keeps the whole context, and the length check refuses it (the seed's
    "truncate to max_model_len, then validate" outcome, which V1 keeps when max_tokens is
    unset); the next request is served."""
    _, tok = hf
    long_chat = [{"role": "user", "content": "Speak the speech, I pray you. " * 40}]
    assert len(chat_prompt_ids(tok, long_chat)) > CTX

    async def go(api):
        with pytest.raises(openai.BadRequestError) as too_big:
            await api.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=10,
                                         extra_body={"truncate_prompt_tokens": CTX - 5})
        with pytest.raises(openai.BadRequestError) as whole:
            await api.chat.completions.create(model=MODEL, messages=long_chat,
                                              extra_body={"truncate_prompt_tokens": -1})
        ok = await api.chat.completions.create(model=MODEL, messages=long_chat, max_tokens=3,
                                               extra_body={"truncate_prompt_tokens": -1})
        return too_big.value, whole.value, ok

    too_big, whole, ok = call(app, go)
    assert too_big.param == "truncate_prompt_tokens"
    assert too_big.body["message"] == (
        f"truncate_prompt_tokens={CTX - 5} cannot be greater than max_model_len - max_tokens "
        f"= {CTX - 10}. Please request a smaller truncation size.")
    assert f"maximum context length is {CTX} tokens" in whole.body["message"]
    assert f"your request has {CTX} input tokens" in whole.body["message"]
    assert ok.usage.prompt_tokens == CTX - 3 and ok.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- 10: chat_template_kwargs
def test_chat_template_kwargs_merge_as_v1(app, hf):
    """V1's build_chat_params: the request's add_generation_prompt / reasoning_effort win over
    the same keys in chat_template_kwargs, other keys reach the template, chat_template among
    them is refused with V1's message."""
    _, tok = hf
    template = ("{{ reasoning_effort }}|{{ greeting }}|"
                "{% for m in messages %}{{ m.content }}{% endfor %}")

    async def go(api):
        overridden = await api.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=1,
            extra_body={"chat_template_kwargs": {"add_generation_prompt": False},
                        "return_token_ids": True})
        custom = await api.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=1, reasoning_effort="high",
            extra_body={"chat_template": template, "return_token_ids": True,
                        "chat_template_kwargs": {"reasoning_effort": "low",
                                                 "greeting": "HAMLET:"}})
        with pytest.raises(openai.BadRequestError) as refused:
            await api.chat.completions.create(
                model=MODEL, messages=USER, max_tokens=1,
                extra_body={"chat_template_kwargs": {"chat_template": template}})
        return overridden, custom, refused.value

    overridden, custom, refused = call(app, go)
    assert overridden.model_extra["prompt_token_ids"] == chat_prompt_ids(tok)  # with the prompt
    expected = tok("high|HAMLET:|" + USER[0]["content"], add_special_tokens=False).input_ids
    assert custom.model_extra["prompt_token_ids"] == expected
    assert "Found unexpected chat template kwargs from request" in refused.body["message"]
    assert refused.param == "messages"


# ---------------------------------------------------------------- 11: the empty model name
def test_empty_model_name_is_the_base_model(app, hf):
    """The seed's (and V1's) _is_model_supported: an empty name is the base model."""
    model, tok = hf

    async def go(api):
        return (await api.completions.create(model="", prompt="ROMEO:", max_tokens=3,
                                             temperature=0, extra_body={"ignore_eos": True}),
                await api.chat.completions.create(model="", messages=USER, max_tokens=1))

    comp, chat = call(app, go)
    assert comp.model == MODEL and chat.model == MODEL
    ref = greedy_ids(model, tok("ROMEO:").input_ids, 3)
    assert comp.choices[0].text == tok.decode(ref, skip_special_tokens=True)


# ---------------------------------------------------------------- 12 + 17: request ids
def test_duplicate_request_ids_are_both_served(app, async_llm, hf):
    """V1 runs a request as f"{id}-{random8}", so two in flight with the same X-Request-Id
    are both served, each answered under the caller's id; a completion's one prompt runs as
    f"{id}-0" (the seed's per-prompt name), a chat as its id. Before: the second got 400
    "already in flight"."""
    model, tok = hf
    ref = tok.decode(greedy_ids(model, tok("ROMEO:").input_ids, 12), skip_special_tokens=True)

    async def go(api):
        def one():
            return api.completions.with_raw_response.create(
                model=MODEL, prompt="ROMEO:", max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "twin"})
        raws = await asyncio.gather(one(), one())
        chat = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=USER, max_tokens=1, extra_headers={"X-Request-Id": "twin"})
        return raws, chat

    raws, chat = call(app, go)
    for raw in raws:
        assert raw.headers["x-request-id"] == "twin"
        c = raw.parse()
        assert c.id == "cmpl-twin" and c.choices[0].text == ref
    assert chat.headers["x-request-id"] == "twin" and chat.parse().id == "chatcmpl-twin"
    ids = [i for i in engine_ids(async_llm) if "twin" in i]
    assert len(ids) == 3 and len(set(ids)) == 3
    # the first keeps its name, its twin in flight runs suffixed (V1 suffixes every one)
    assert sorted(ids[:2])[0] == "cmpl-twin-0", ids
    assert re.fullmatch(r"cmpl-twin-0-[0-9a-f]{8}", sorted(ids[:2])[1]), ids
    assert ids[2] == "chatcmpl-twin", ids  # nothing in flight under it any more


def test_a_disconnect_aborts_only_its_own_twin(app, async_llm, hf):
    """Two streams with the same request_id; the first client leaves after two chunks: its
    engine request is aborted (its blocks freed: the autouse check), the twin streams on to
    transformers' text."""
    model, tok = hf
    ref = tok.decode(greedy_ids(model, tok("JULIET:").input_ids, 30), skip_special_tokens=True)
    body = {"model": MODEL, "prompt": "JULIET:", "max_tokens": 30, "temperature": 0,
            "ignore_eos": True, "stream": True, "request_id": "pair"}

    async def go():
        leaver = asyncio.ensure_future(drive_asgi(app, body, disconnect_after_chunks=2))
        async with client(app) as c:
            stayer = await c.post("/v1/completions", json=body)
        return await leaver, stayer

    left_chunks, stayer = asyncio.run(go())
    events = sse_events(stayer.text)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == ref
    assert {e["id"] for e in events} == {"cmpl-pair"}
    assert not b"".join(left_chunks).endswith(b"data: [DONE]\n\n")  # it did leave early
    rows = asyncio.run(async_llm.call(lambda: async_llm.engine.requests_dataframe()))
    reasons = sorted(row["finish_reason"] for _, row in rows.iterrows()
                     if row["request_id"].startswith("cmpl-pair-0"))
    assert reasons == ["abort", "length"], reasons


def test_a_twin_that_leaves_while_added_never_aborts_the_first(async_llm, monkeypatch):
    """A hostile twin: requests under an id in flight, cancelled at different moments of
    being added (input thread, queued for the engine thread, done, and once inside the engine
    thread's add: it waits there for the cancel). Only its own engine request is ever
    aborted: the first runs to its length (before, a cancel aborted the id it named), and
    every twin that reached the engine ends "abort" (before, no cancel landed inside the add)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = async_llm.engine
    real_add, held = engine.add_request, []
    hold, adding, left = threading.Event(), threading.Event(), threading.Event()

    def add_request(request_id, *args, **kwargs):  # on the engine thread
        if hold.is_set() and not held:
            held.append(request_id)
            adding.set()
            left.wait(10)  # the caller leaves while the engine thread is inside the add
        return real_add(request_id, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", add_request)

    async def go():
        first = await async_llm.add_request("ROMEO:", params, "solo")
        cancelled = []  # the delays whose twin raised CancelledError
        for delay in (0, 0.0005, 0.002, 0.005, 0.01, 0.03, None):
            if delay is None:
                hold.set()
            twin = asyncio.ensure_future(async_llm.add_request("JULIET:", params, "solo"))
            if delay is None:
                await asyncio.to_thread(adding.wait, 10)
            else:
                await asyncio.sleep(delay)
            twin.cancel()
            if delay is None:
                left.set()  # the held add goes on, its caller gone
            try:
                (await twin).close()  # it was added before the cancel: leave it now
            except asyncio.CancelledError:
                cancelled.append(delay)
        outs = [out async for out in first]
        await wait_all_free(async_llm, num_blocks=BLOCKS)
        history = await async_llm.get_history()
        twins = {e.request_id: e.reason for record in history for e in record.request_events
                 if isinstance(e, RequestFinished) and e.request_id.startswith("solo-")}
        return outs, first, twins, cancelled

    outs, first, twins, cancelled = asyncio.run(asyncio.wait_for(go(), 30))
    assert first.request_id == "solo" and not first.aborted
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert len(outs[-1].outputs[0].token_ids) == 40
    assert None in cancelled and held[0] in twins  # cancelled inside its add, then ended
    assert set(twins.values()) == {"abort"}, twins


# ---------------------------------------------------------------- 13: adjust_request
def test_adjust_request_runs_unless_tool_choice_is_none(app, monkeypatch):
    """The seed's (and V1's) _preprocess_chat: with a tool-call parser configured,
    adjust_request runs for every tool_choice but "none" ("required" and named too)."""
    seen = []
    original = Hermes2ProToolParser.adjust_request

    def spy(self, request):
        seen.append(request.tool_choice if isinstance(request.tool_choice, str) else "named")
        return original(self, request)

    monkeypatch.setattr(Hermes2ProToolParser, "adjust_request", spy)
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def go(api):
        for choice in ("required", named, "none"):
            await api.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                              tool_choice=choice, max_tokens=2)

    call(app, go)
    assert seen == ["required", "named"]


# ---------------------------------------------------------------- 14: stream errors, unset fields
def test_a_stream_failing_with_any_exception_ends_with_an_error_and_done(app, monkeypatch, hf):
    """V1's stream generators catch every Exception: an error event (create_error_response's
    classes: a KeyError is a 500), then ``data: [DONE]``; a stream running beside it is
    untouched and gives transformers' text; the official client raises APIError."""
    model, tok = hf
    ref = tok.decode(greedy_ids(model, tok("ROMEO:").input_ids, 20), skip_special_tokens=True)
    original = chat_module.ChatFormat.stream_choice

    def hostile(self, state, delta):
        if self.req.user == "hostile" and state.text:
            raise KeyError("injected")
        return original(self, state, delta)

    monkeypatch.setattr(chat_module.ChatFormat, "stream_choice", hostile)
    chat = {"model": MODEL, "messages": USER, "max_tokens": 20, "stream": True,
            "ignore_eos": True, "user": "hostile"}

    async def go():
        async with client(app) as c:
            return await asyncio.gather(
                c.post("/v1/chat/completions", json=chat),
                c.post("/v1/completions", json={"model": MODEL, "prompt": "ROMEO:", "stream": True,
                                                "max_tokens": 20, "temperature": 0,
                                                "ignore_eos": True}))

    bad, good = asyncio.run(go())
    events = sse_events(bad.text)  # ends with data: [DONE]
    assert events[-1] == {"error": {"message": "'injected'", "type": "InternalServerError",
                                    "param": None, "code": 500}}
    assert "".join(e["choices"][0]["text"] for e in sse_events(good.text)) == ref

    async def with_client(api):
        stream = await api.chat.completions.create(model=MODEL, messages=USER, max_tokens=20,
                                                   stream=True, user="hostile")
        with pytest.raises(openai.APIError, match="injected"):
            async for _ in stream:
                pass

    call(app, with_client)


def test_chunks_leave_unset_fields_out(app):
    """vLLM's chunks are exclude_unset: no "usage" unless asked (then on every chunk with
    continuous_usage_stats, or one final chunk); a chat chunk's stop_reason only where its
    choice finishes; a completion chunk keeps its choice's finish_reason and logprobs."""
    async def go():
        async with client(app) as c:
            return await asyncio.gather(
                c.post("/v1/chat/completions", json={"model": MODEL, "messages": USER,
                                                     "max_tokens": 4, "stream": True}),
                c.post("/v1/completions", json={"model": MODEL, "prompt": "ROMEO:",
                                                "max_tokens": 4, "stream": True, "logprobs": 1}),
                c.post("/v1/completions", json={
                    "model": MODEL, "prompt": "ROMEO:", "max_tokens": 3, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))

    plain_chat, plain_comp, usage = asyncio.run(go())
    chat_chunks, comp_chunks = sse_events(plain_chat.text), sse_events(plain_comp.text)
    assert all("usage" not in ch for ch in chat_chunks + comp_chunks)
    assert all(ch["object"] == "chat.completion.chunk" for ch in chat_chunks)
    assert all(ch["object"] == "text_completion" for ch in comp_chunks)
    assert all("stop_reason" not in ch["choices"][0] for ch in chat_chunks[:-1])
    last = chat_chunks[-1]["choices"][0]
    assert last["finish_reason"] == "length" and last["stop_reason"] is None
    assert all(ch["choices"][0]["finish_reason"] is None for ch in chat_chunks[:-1])
    for ch in comp_chunks:
        lp = ch["choices"][0]["logprobs"]
        assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
        assert "finish_reason" in ch["choices"][0]
    usage_chunks = sse_events(usage.text)
    assert all("usage" in ch for ch in usage_chunks)
    assert usage_chunks[-1]["choices"] == [] and usage_chunks[-1]["usage"]["completion_tokens"] == 3


# ---------------------------------------------------------------- 15: arrival time
def test_arrival_is_stamped_before_rendering(app, async_llm, monkeypatch):
    """The seed stamps arrival_time before rendering: a slow chat template (0.4 s on the
    input thread) counts in the request's queue time, TTFT and e2e, and the timeline keeps
    its order (arrival <= first scheduled <= first token <= finished)."""
    processor = async_llm.input_processor
    original = processor.render_chat

    def slow(*args, **kwargs):
        time.sleep(0.4)
        return original(*args, **kwargs)

    monkeypatch.setattr(processor, "render_chat", slow)

    async def go():
        async with client(app) as c:
            t0 = time.monotonic()
            r = await c.post("/v1/chat/completions", json={
                "model": MODEL, "messages": USER, "max_tokens": 2},
                headers={"X-Request-Id": "slow-render"})
            wall = time.monotonic() - t0
        rows = await async_llm.call(lambda: async_llm.engine.requests_dataframe())
        return r, wall, rows

    r, wall, rows = asyncio.run(go())
    assert r.status_code == 200, r.text
    (row,) = [row for _, row in rows.iterrows() if row["request_id"] == "chatcmpl-slow-render"]
    assert 0.4 <= row["queue_s"] <= row["ttft_s"] <= row["e2e_s"] <= wall
    assert row["arrival_step"] <= row["first_scheduled_step"] <= row["finished_step"]
