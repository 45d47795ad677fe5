"""The server's thread rule: each request's input is processed once, on AsyncLLM's input thread
(the engine thread never tokenizes or decodes a prompt), and no thread but the engine thread
touches the engine while the server answers every kind of request; each request asks the
engine for the outputs it needs (vLLM's rule: DELTA when streaming, else one FINAL_ONLY)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import transformers

from workbench import LLMEngine, default_model_path
from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.openai import protocol as P
from workbench.entrypoints.openai.api_server import build_app
from workbench.sampling_params import RequestOutputKind

from serving_support import GOOD, MODEL, client, drive_asgi, sse_events, wait_all_free

ENGINE_THREAD = "workbench-engine"
NUM_BLOCKS = 64
CHAT = [{"role": "system", "content": "Thou art a player."},
        {"role": "user", "content": "Speak the speech, I pray you, as I pronounced it to you."}]


def guard(engine: LLMEngine, offenders: list[tuple[str, str]]) -> None:
    """Record ``(attribute, thread)`` for every attribute of ``engine`` read off its thread."""
    base = type(engine)

    class EngineThreadOnly(base):
        def __getattribute__(self, name):
            thread = threading.current_thread().name
            if thread != ENGINE_THREAD:
                offenders.append((name, thread))
            return base.__getattribute__(self, name)

    engine.__class__ = EngineThreadOnly


@pytest.fixture(scope="module")
def served():
    """(async_llm, app, offenders): the engine guarded from the moment AsyncLLM holds it."""
    offenders: list[tuple[str, str]] = []
    llm = AsyncLLM(LLMEngine(device="cpu", block_size=8, num_kv_blocks=NUM_BLOCKS))
    guard(llm.engine, offenders)
    yield llm, build_app(llm, model_name=MODEL), offenders
    asyncio.run(llm.shutdown())


class Counting:
    """Wraps a tokenizer (or its Rust backend): records ``(call, thread)`` of every encode,
    decode and chat rendering, and delegates everything."""

    def __init__(self, inner, calls: list[tuple[str, str]]) -> None:
        self._inner, self._calls = inner, calls

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        kind = {"encode": "encode", "encode_batch": "encode", "decode": "decode",
                "batch_decode": "decode", "decode_batch": "decode",
                "apply_chat_template": "render"}.get(name)
        if kind is None:
            return Counting(value, self._calls) if name == "backend_tokenizer" else value

        def call(*args, **kwargs):
            self._calls.append((kind, threading.current_thread().name))
            return value(*args, **kwargs)

        return call

    def __call__(self, *args, **kwargs):
        self._calls.append(("encode", threading.current_thread().name))
        return self._inner(*args, **kwargs)


def test_a_truncated_chat_is_encoded_once_and_never_decoded_on_the_engine_thread(
        served, monkeypatch):
    async_llm, app, _ = served
    tok = transformers.AutoTokenizer.from_pretrained(default_model_path())
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(async_llm.input_processor, "tokenizer",
                        Counting(async_llm.input_processor.tokenizer, calls))

    async def go():
        async with client(app) as c:
            return await c.post("/v1/chat/completions", json={
                "model": MODEL, "messages": CHAT, "max_tokens": 3, "temperature": 0,
                "truncate_prompt_tokens": 5})

    response = asyncio.run(go())
    assert response.status_code == 200, response.text
    # the reference: transformers renders the chat, then the last 5 of its tokens are kept
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert len(tok(text, add_special_tokens=False).input_ids) > 5
    assert response.json()["usage"]["prompt_tokens"] == 5
    kinds = [kind for kind, _ in calls]
    assert kinds.count("render") == 1 and kinds.count("encode") == 1
    assert kinds.count("decode") == 1  # the kept tokens' text, for the request's prompt
    assert all(thread != ENGINE_THREAD and thread.startswith("workbench-inputs")
               for _, thread in calls), calls


def test_no_thread_but_the_engine_thread_touches_the_engine(served):
    async_llm, app, offenders = served
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}

    async def go():
        async with client(app) as c:
            answers = await asyncio.gather(
                c.post("/v1/chat/completions", json={**chat, "truncate_prompt_tokens": 5}),
                c.post("/v1/chat/completions", json={**chat, "stream": True, "logprobs": True,
                                                     "top_logprobs": 2}),
                c.post("/v1/completions", json={**GOOD, "prompt": [5, 6, 7], "echo": True,
                                                "logprobs": 1, "n": 2}),
                c.post("/v1/completions", json={**GOOD, "stream": True, "echo": True}),
                c.post("/v1/completions", json={**GOOD, "priority": 1}),  # refused: fcfs
                c.post("/v1/completions", json={**GOOD, "logprobs": 21}),  # refused: the limit
                c.post("/tokenize", json={"prompt": "ROMEO:"}),
                c.post("/tokenize", json={"messages": CHAT}),
                c.post("/detokenize", json={"tokens": [5, 6, 7]}),
                c.get("/v1/models"), c.get("/health"), c.get("/metrics"),
            )
        await drive_asgi(app, {**GOOD, "max_tokens": 200, "stream": True}, 2)  # client leaves
        await wait_all_free(async_llm, num_blocks=NUM_BLOCKS)
        return answers

    answers = asyncio.run(go())
    assert [a.status_code for a in answers] == [200] * 4 + [400, 400] + [200] * 6
    assert sse_events(answers[1].text)[-1]["choices"][0]["finish_reason"] == "length"
    assert "Priority scheduling is not enabled" in answers[4].json()["error"]["message"]
    assert "alive=True" in repr(async_llm) and "engine thread" in async_llm._repr_html_()
    assert offenders == []


@pytest.mark.parametrize("stream, kind", [(True, RequestOutputKind.DELTA),
                                          (False, RequestOutputKind.FINAL_ONLY)])
def test_stream_decides_the_output_kind(stream, kind):
    chat = P.ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], stream=stream)
    cmpl = P.CompletionRequest(prompt="ROMEO:", stream=stream)
    for req in (chat, cmpl):
        assert req.sampling_params(max_tokens=4, logprobs=None, defaults={}).output_kind is kind
