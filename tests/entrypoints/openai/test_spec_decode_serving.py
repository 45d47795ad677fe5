"""Speculative decoding over HTTP: greedy completions equal transformers' tokens and
/metrics carries vLLM's spec_decode series."""

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving_support import MODEL, client, greedy_ids, hf  # noqa: F401 - hf is a fixture

from workbench import LLMEngine
from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.openai.api_server import build_app

PROMPT = "ROMEO:\nO Romeo, Romeo, wherefore art thou Romeo? O Romeo, Romeo,"


@pytest.fixture(scope="module")
def app():
    llm = AsyncLLM(LLMEngine(device="cpu", block_size=8, num_kv_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}))
    yield build_app(llm, model_name=MODEL)
    asyncio.run(llm.shutdown())


def samples(text):
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("vllm:spec_decode")}


def test_greedy_completion_and_spec_metrics(app, hf):  # noqa: F811
    model, tok = hf

    async def go():
        async with client(app) as c:
            done = await c.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            return done, (await c.get("/metrics")).text

    done, metrics = asyncio.run(go())
    assert done.status_code == 200, done.text
    ids = tok(PROMPT).input_ids
    assert done.json()["choices"][0]["token_ids"] == greedy_ids(model, ids, 16)
    got = samples(metrics)
    assert got["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < got["vllm:spec_decode_num_accepted_tokens_total"] <= got["vllm:spec_decode_num_draft_tokens_total"]
