"""The pooling endpoints against transformers' hidden states, through the official ``openai``
client (``embeddings.create``) and plain HTTP (/pooling, /score, /rerank), with the engine in
process and with its core in a child process."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch
import torch.nn.functional as F
import transformers

from workbench import LLMEngine, default_model_path
from workbench.config import EngineArgs
from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.openai.api_server import build_app

from serving_support import MODEL, client, uvicorn_server, wait_all_free

TEXTS = ["ROMEO: But soft, what light through yonder window breaks?", "JULIET:",
         "HAMLET: To be, or not to be, that is the question"]
BLOCKS = 64


@pytest.fixture(scope="module")
def ref():
    path = default_model_path()
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)

    def states(text: str) -> torch.Tensor:
        with torch.no_grad():
            return model(tok(text, return_tensors="pt").input_ids).last_hidden_state[0]
    return states


def pooling_llm(multiprocess: bool) -> AsyncLLM:
    options = dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=BLOCKS,
                   max_model_len=64, runner="pooling", max_num_batched_tokens=16)
    if multiprocess:
        return AsyncLLM.from_engine_args(EngineArgs(multiprocess_mode=True, **options))
    return AsyncLLM(LLMEngine(**options))


@pytest.fixture(scope="module")
def inproc():
    llm = pooling_llm(False)
    yield llm, build_app(llm, model_name=MODEL)
    asyncio.run(llm.shutdown())


@pytest.mark.parametrize("multiprocess", [False, True], ids=["inproc", "core-process"])
def test_official_client_embeddings_equal_transformers(ref, inproc, multiprocess):
    llm = pooling_llm(True) if multiprocess else inproc[0]
    app = build_app(llm, model_name=MODEL) if multiprocess else inproc[1]
    try:
        with uvicorn_server(app) as base_url:
            api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
            as_floats = api.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
            as_base64 = api.embeddings.create(model=MODEL, input=TEXTS)  # the client asks base64
        assert as_floats.object == "list" and as_floats.model == MODEL
        assert [d.index for d in as_floats.data] == [0, 1, 2]
        for text, a, b in zip(TEXTS, as_floats.data, as_base64.data):
            expected = F.normalize(ref(text)[-1], dim=-1)
            assert torch.allclose(torch.tensor(a.embedding), expected, atol=1e-5)
            assert torch.allclose(torch.tensor(b.embedding, dtype=torch.float32), expected, atol=1e-5)
        n = sum(len(ref(t)) for t in TEXTS)
        assert as_floats.usage.prompt_tokens == n and as_floats.usage.total_tokens == n
        asyncio.run(wait_all_free(llm, num_blocks=BLOCKS))
    finally:
        if multiprocess:
            asyncio.run(llm.shutdown())


def post(app, path, body):
    async def go():
        async with client(app) as c:
            return await c.post(path, json=body)
    return asyncio.run(go())


def test_pooling_endpoint_token_embed_and_embed(ref, inproc):
    _, app = inproc
    r = post(app, "/pooling", {"model": MODEL, "input": TEXTS[1]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("pool-") and body["data"][0]["object"] == "pooling"
    assert torch.allclose(torch.tensor(body["data"][0]["data"]), F.normalize(ref(TEXTS[1]), dim=-1),
                          atol=1e-5)
    r = post(app, "/pooling", {"model": MODEL, "input": [TEXTS[0]], "task": "embed"})
    assert torch.allclose(torch.tensor(r.json()["data"][0]["data"]),
                          F.normalize(ref(TEXTS[0])[-1], dim=-1), atol=1e-5)
    r = post(app, "/pooling", {"model": MODEL, "input": "x", "task": "classify"})
    assert r.status_code == 400 and "Task classify is not supported" in r.json()["error"]["message"]


def test_score_and_rerank_are_cosine_similarities(ref, inproc):
    _, app = inproc
    emb = [F.normalize(ref(t)[-1], dim=-1) for t in TEXTS]
    r = post(app, "/score", {"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS[1:]})
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    assert scores == pytest.approx([float(emb[0] @ emb[1]), float(emb[0] @ emb[2])], abs=1e-5)
    r = post(app, "/rerank", {"model": MODEL, "query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1})
    (best,) = r.json()["results"]
    assert best["index"] == max((0, 1), key=lambda i: scores[i])
    assert best["relevance_score"] == pytest.approx(max(scores), abs=1e-5)
    r = post(app, "/score", {"model": MODEL, "text_1": TEXTS[:2], "text_2": TEXTS})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Input lengths must be either 1:1, 1:N or N:N"


def test_validation_in_vllms_words(inproc):
    llm, app = inproc
    long = "ROMEO: " * 80
    cases = [
        ("/v1/embeddings", {"input": long}, "However, you requested"),
        ("/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": 65},
         "truncate_prompt_tokens value is greater than max_model_len. Please, select a smaller "
         "truncation size."),
        ("/v1/embeddings", {"input": "hi", "dimensions": 8}, "does not support matryoshka"),
        ("/score", {"text_1": long, "text_2": "hi"}, "tokens in the input for score."),
        ("/v1/completions", {"prompt": "hi"}, "The model does not support Completions API"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
         "The model does not support Chat Completions API"),
    ]
    for path, body, words in cases:
        r = post(app, path, {"model": MODEL, **body})
        assert r.status_code == 400, (path, r.text)
        assert words in r.json()["error"]["message"], (path, r.text)
    assert "for embedding generation" in post(app, "/v1/embeddings",
                                              {"input": long}).json()["error"]["message"]
    r = post(app, "/v1/embeddings", {"input": long, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 64  # the whole context
    asyncio.run(wait_all_free(llm, num_blocks=BLOCKS))


def test_a_generative_model_refuses_embeddings():
    llm = AsyncLLM(LLMEngine(device="cpu", block_size=8, num_kv_blocks=16))
    try:
        app = build_app(llm, model_name=MODEL)
        for path, body, words in [("/v1/embeddings", {"input": "hi"}, "Embeddings API"),
                                  ("/score", {"text_1": "a", "text_2": "b"}, "Score API"),
                                  ("/rerank", {"query": "a", "documents": ["b"]}, "Rerank")]:
            r = post(app, path, {"model": MODEL, **body})
            assert r.status_code == 400
            assert r.json()["error"]["message"].startswith(f"The model does not support {words}")
    finally:
        asyncio.run(llm.shutdown())
