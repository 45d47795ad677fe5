"""``use_beam_search`` over HTTP with the official ``openai`` client (``extra_body``): the
choices are transformers' beams (``generate(num_beams=n, ...)``, EOS an ordinary token as
with ``ignore_eos``), best first; vLLM's rules and this server's limits answer 400 naming
the field; no KV block stays held."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import torch

from workbench import LLMEngine
from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.openai.api_server import build_app

from serving_support import KEY, MODEL, NUM_BLOCKS, hf, uvicorn_server, wait_all_free  # noqa: F401

USER = [{"role": "user", "content": "Good morrow, sweet lady."}]


@pytest.fixture(scope="module")
def served():
    llm = AsyncLLM(LLMEngine(device="cpu", dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS))
    app = build_app(llm, model_name=MODEL, api_key=KEY)
    with uvicorn_server(app) as base_url:
        yield llm, openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    asyncio.run(llm.shutdown())


def hf_beams(hf, ids, width, n, length_penalty=1.0):
    """transformers' beams of ``n`` new tokens (generated ids, cum logprob), best first."""
    model, _ = hf
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), num_beams=width,
                             num_return_sequences=width, do_sample=False, early_stopping=True,
                             length_penalty=length_penalty, max_new_tokens=n, eos_token_id=None,
                             output_scores=True, return_dict_in_generate=True)
    return [(s[len(ids):].tolist(), float(score) * n ** length_penalty)
            for s, score in zip(out.sequences, out.sequences_scores)]


def test_completions_beams_equal_transformers(served, hf):
    llm, api = served
    _, tok = hf
    prompts = ["ROMEO:", "HAMLET:\nTo be, or not to be"]
    c = api.completions.create(model=MODEL, prompt=prompts, max_tokens=6, n=3,
                               extra_body={"use_beam_search": True, "ignore_eos": True,
                                           "length_penalty": 0.5, "return_token_ids": True})
    assert [ch.index for ch in c.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        ref = hf_beams(hf, tok(prompt).input_ids, 3, 6, 0.5)
        for choice, (ids, _) in zip(c.choices[3 * i: 3 * i + 3], ref):
            assert choice.token_ids == ids
            assert choice.text == tok.decode(ids, skip_special_tokens=True)
            assert choice.finish_reason == "length"
    assert c.usage.completion_tokens == 6 * 6
    asyncio.run(wait_all_free(llm))


def test_chat_beams_and_stream(served, hf):
    llm, api = served
    _, tok = hf
    ids = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    ref = hf_beams(hf, ids, 2, 5)
    r = api.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=5, n=2,
                                    extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [ch.message.content for ch in r.choices] == [
        tok.decode(t, skip_special_tokens=True) for t, _ in ref]
    chunks = list(api.chat.completions.create(
        model=MODEL, messages=USER, max_completion_tokens=5, n=2, stream=True,
        extra_body={"use_beam_search": True, "ignore_eos": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert [texts[0], texts[1]] == [ch.message.content for ch in r.choices]
    asyncio.run(wait_all_free(llm))


def test_eos_finishes_a_beam(served, hf):
    """Without ignore_eos a beam that picks EOS is finished (``stop``); its text and
    token_ids hold no EOS unless include_stop_str_in_output."""
    _, api = served
    _, tok = hf
    eos = tok.eos_token_id
    body = {"use_beam_search": True, "return_token_ids": True}
    # six beams of twelve tokens: some of them end their line of verse with EOS
    c = api.completions.create(model=MODEL, prompt="HAMLET:\nTo be, or not to be", max_tokens=12,
                               n=6, extra_body=body)
    stopped = [ch for ch in c.choices if ch.finish_reason == "stop"]
    assert stopped, [ch.finish_reason for ch in c.choices]
    assert all(eos not in ch.token_ids for ch in c.choices)
    c2 = api.completions.create(model=MODEL, prompt="HAMLET:\nTo be, or not to be", max_tokens=12,
                                n=6, extra_body={**body, "include_stop_str_in_output": True})
    assert [ch.token_ids[:-1] if ch.finish_reason == "stop" else ch.token_ids for ch in c2.choices] \
        == [ch.token_ids for ch in c.choices]
    assert all(ch.token_ids[-1] == eos for ch in c2.choices if ch.finish_reason == "stop")


@pytest.mark.parametrize("kwargs, param", [
    ({"stream": True}, "stream"),                  # vLLM: no streaming beam search (completions)
    ({"logprobs": 2}, "logprobs"),
    ({"n": 11}, "n"),                              # 2 * n logprobs per step > max_logprobs 20
    ({"temperature": -1.0}, "temperature"),
    ({"max_tokens": 5000}, "max_tokens"),          # beyond the context, vLLM's wording
    ({"max_tokens": 600}, "max_tokens"),           # within it, beyond the 64 blocks of 8
    ({"extra_body": {"use_beam_search": True, "prompt_logprobs": 1}}, "prompt_logprobs"),
])
def test_beam_search_errors_name_the_field(served, kwargs, param):
    llm, api = served
    kwargs = {"n": 2, "max_tokens": 4, **kwargs}
    kwargs.setdefault("extra_body", {"use_beam_search": True})
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=MODEL, prompt="ROMEO:", **kwargs)
    assert info.value.body["param"] == param and info.value.body["message"]
    asyncio.run(wait_all_free(llm))


def test_a_client_that_leaves_stops_the_search(served):
    """A client that gives up (its timeout) cancels the search: its step requests are aborted,
    every block is freed and no further beam step runs, before the same search run to its end
    by a client that waits would have stopped."""
    llm, api = served
    # 480 tokens: the whole search fits the fixture's 512 cache slots
    body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 480, "n": 3, "use_beam_search": True,
            "ignore_eos": True}
    url, headers = f"{str(api.base_url).rstrip('/')}/completions", {"Authorization": f"Bearer {KEY}"}
    engine = llm.engine

    def beam_steps(name: str) -> tuple[int, int]:
        return len(engine.history), sum(
            any(s.request_id.startswith(f"cmpl-{name}") for s in r.scheduler_output.scheduled)
            for r in engine.history)

    with pytest.raises(httpx.TimeoutException):
        httpx.post(url, timeout=0.5, headers=headers, json={**body, "request_id": "leaver"})

    async def steps_after_the_leaver() -> tuple[int, int]:
        # Between two beam steps the engine is idle with every block free for a moment, maybe
        # before the disconnect reaches the search: it has stopped once no step runs for 0.3 s
        deadline = time.monotonic() + 10.0
        while True:
            await wait_all_free(llm)
            before = await llm.call(lambda: beam_steps("leaver"))
            await asyncio.sleep(0.3)
            if await llm.call(lambda: beam_steps("leaver")) == before:
                break
            assert time.monotonic() < deadline, "the search kept stepping after its client left"
        await asyncio.sleep(0.5)
        assert await llm.call(lambda: beam_steps("leaver")) == before
        return before

    _, leaver_steps = asyncio.run(steps_after_the_leaver())
    assert httpx.post(url, timeout=120.0, headers=headers,
                      json={**body, "request_id": "stayer"}).status_code == 200
    _, whole_search = asyncio.run(llm.call(lambda: beam_steps("stayer")))
    assert 0 < leaver_steps < whole_search
