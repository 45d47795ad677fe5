"""The official ``openai`` client against the server on 127.0.0.1: it parses every response
and chunk into its own types (so the shapes are OpenAI's), and maps our errors to its
exception classes by status. Texts are checked against transformers' greedy tokens."""

from __future__ import annotations

import asyncio

import openai
import pytest

from workbench import LLMEngine
from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.openai.api_server import build_app

from serving_support import KEY, MODEL, NUM_BLOCKS, greedy_ids, hf, uvicorn_server

USER = [{"role": "user", "content": "Good morrow, sweet lady."}]


@pytest.fixture(scope="module")
def api():
    llm = AsyncLLM(LLMEngine(device="cpu", block_size=8, num_kv_blocks=NUM_BLOCKS))
    app = build_app(llm, model_name=MODEL, api_key=KEY)
    with uvicorn_server(app) as base_url:
        yield openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=30)
    asyncio.run(llm.shutdown())


def greedy_text(hf, ids, n):
    model, tok = hf
    return tok.decode(greedy_ids(model, ids, n))


def test_models_list(api):
    assert [m.id for m in api.models.list()] == [MODEL]


def test_completion_shapes_n_logprobs_echo(api, hf):
    _, tok = hf
    ids = tok("ROMEO:").input_ids
    ref = greedy_text(hf, ids, 5)
    c = api.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=5, temperature=0,
                               n=2, logprobs=2, echo=True, extra_body={"ignore_eos": True})
    assert c.object == "text_completion" and c.model == MODEL and c.id.startswith("cmpl-")
    assert [ch.index for ch in c.choices] == [0, 1]
    assert all(ch.text == "ROMEO:" + ref and ch.finish_reason == "length" for ch in c.choices)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 5 and lp.token_logprobs[0] is None
    # the top 2, plus the chosen token when it is not among them (vLLM's rule)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert c.usage.prompt_tokens == len(ids) and c.usage.completion_tokens == 10
    assert c.usage.total_tokens == len(ids) + 10


def test_completion_stream_with_usage(api, hf):
    _, tok = hf
    ref = greedy_text(hf, tok("JULIET:").input_ids, 6)
    chunks = list(api.completions.create(
        model=MODEL, prompt="JULIET:", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_chat_shapes_and_stream(api, hf):
    _, tok = hf
    ids = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    ref = greedy_text(hf, ids, 6)
    r = api.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=6,
                                    temperature=0, logprobs=True, top_logprobs=2,
                                    extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref and r.usage.prompt_tokens == len(ids)
    assert len(r.choices[0].logprobs.content) == 6
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
    chunks = list(api.chat.completions.create(model=MODEL, messages=USER, max_tokens=6,
                                              temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs, error, param", [
    ({"temperature": -1}, openai.BadRequestError, "temperature"),
    ({"model": "gpt-5"}, openai.NotFoundError, "model"),
    ({"extra_body": {"top_logprobs": 3}}, openai.BadRequestError, "top_logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {  # the compiler refuses it
        "name": "x", "schema": {"type": "objectx"}}}}, openai.BadRequestError, "response_format"),
    ({"messages": [{"role": "villain", "content": "Ha"}]}, openai.BadRequestError, "messages"),
])
def test_errors_map_to_the_clients_exceptions(api, kwargs, error, param):
    args = {"model": MODEL, "messages": USER, "max_tokens": 2, **kwargs}
    with pytest.raises(error) as info:
        api.chat.completions.create(**args)
    assert info.value.body["param"] == param and info.value.body["message"]
    served = api.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert served.choices[0].finish_reason in ("length", "stop")


def test_api_key_is_required(api):
    wrong = openai.OpenAI(base_url=str(api.base_url), api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
