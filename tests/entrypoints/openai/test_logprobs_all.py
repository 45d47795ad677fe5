"""``logprobs: -1`` / ``top_logprobs: -1`` (vLLM: the whole vocabulary) on a server whose
engine has ``max_logprobs=-1`` (no limit); the probabilities of each position sum to one and
the chosen token's logprob is transformers' log-softmax of its logits."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from workbench import LLMEngine
from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.openai.api_server import build_app

from serving_support import MODEL, client, hf  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def app():
    llm = AsyncLLM(LLMEngine(device="cpu", block_size=8, num_kv_blocks=32, max_logprobs=-1))
    yield build_app(llm, model_name=MODEL)
    asyncio.run(llm.shutdown())


def post(app, path, body):
    async def go():
        async with client(app) as c:
            return await c.post(path, json=body)
    return asyncio.run(go())


def test_the_whole_vocabulary(app, hf):
    model, tok = hf
    vocab = model.config.vocab_size
    r = post(app, "/v1/completions", {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 2,
                                      "temperature": 0, "logprobs": -1, "ignore_eos": True})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ids = tok("ROMEO:").input_ids
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
    first = lp["top_logprobs"][0]
    # every token (keyed by its text, so tokens that print alike share one key)
    assert len(first) == len({tok.decode([t]) for t in range(vocab)})
    assert math.isclose(lp["token_logprobs"][0], ref.max().item(), abs_tol=1e-4)
    r = post(app, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hark!"}], "max_tokens": 2,
        "temperature": 0, "logprobs": True, "top_logprobs": -1})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert all(len(t["top_logprobs"]) == vocab for t in content)
    assert all(math.isclose(sum(math.exp(c["logprob"]) for c in t["top_logprobs"]), 1.0,
                            rel_tol=1e-3) for t in content)
