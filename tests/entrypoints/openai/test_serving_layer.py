"""Seed 000/002's serving layer, each behind vLLM's flag: the request logger, load tracking and
its ORCA metrics header, SSE keep-alive comments, log_error_stack; and AsyncLLM's
check_health, get_*_config and collective_rpc (one worker)."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from workbench import LLMEngine
from workbench.engine.async_llm import AsyncLLM, EngineDeadError
from workbench.entrypoints.openai import load_tracking
from workbench.entrypoints.openai.api_server import build_app

from serving_support import MODEL, client, uvicorn_server

BODY = {"model": MODEL, "prompt": "ROMEO: But soft", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def llm():
    llm = AsyncLLM(LLMEngine(device="cpu", block_size=8, num_kv_blocks=32))
    yield llm
    asyncio.run(llm.shutdown())


def post(app, path, body, headers=None):
    async def go():
        async with client(app) as c:
            return await c.post(path, json=body, headers=headers or {})
    return asyncio.run(go())


def test_request_logger_cuts_prompts_to_max_log_len(llm, caplog):
    app = build_app(llm, model_name=MODEL, enable_log_requests=True, max_log_len=5)
    tok = llm.input_processor.tokenizer
    with caplog.at_level(logging.INFO, logger="workbench.entrypoints.openai"):
        r = post(app, "/v1/completions", {**BODY, "request_id": "abc"})
    assert r.status_code == 200
    (line,) = [m for m in caplog.messages if m.startswith("Received request")]
    ids = tok("ROMEO: But soft").input_ids
    assert line.startswith("Received request cmpl-abc-0: prompt: 'ROMEO', params: SamplingParams(")
    assert f"prompt_token_ids: {ids[:5]}," in line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="workbench.entrypoints.openai"):
        post(build_app(llm, model_name=MODEL), "/v1/completions", BODY)
    assert not [m for m in caplog.messages if m.startswith("Received request")]  # off by default


def test_orca_metrics_header_in_text_and_json(llm):
    app = build_app(llm, model_name=MODEL)
    post(app, "/v1/completions", BODY)  # one step done: stats exist
    stats = llm.scheduler_stats
    r = post(app, "/v1/completions", BODY, {"endpoint-load-metrics-format": "TEXT"})
    text = r.headers["endpoint-load-metrics"]
    assert text.startswith("TEXT named_metrics.kv_cache_usage_perc=")
    assert "named_metrics.num_requests_waiting=" in text
    r = post(app, "/v1/completions", BODY, {"endpoint-load-metrics-format": "JSON"})
    kind, _, payload = r.headers["endpoint-load-metrics"].partition(" ")
    named = json.loads(payload)["named_metrics"]
    assert kind == "JSON" and set(named) == {"kv_cache_usage_perc", "num_requests_waiting"}
    assert 0.0 <= named["kv_cache_usage_perc"] <= 1.0 and named["num_requests_waiting"] == 0.0
    assert stats is not None
    assert load_tracking.metrics_header("TEXT", stats)["endpoint-load-metrics"] == (
        f"TEXT named_metrics.kv_cache_usage_perc={float(stats.kv_cache_usage)}, "
        f"named_metrics.num_requests_waiting={float(stats.num_waiting_reqs)}")
    assert "endpoint-load-metrics" not in post(app, "/v1/completions", BODY).headers


def test_load_tracking_counts_a_stream_until_it_ends(llm):
    app = build_app(llm, model_name=MODEL, enable_server_load_tracking=True)
    with uvicorn_server(app) as base, httpx.Client(base_url=base, timeout=30) as http:
        assert http.get("/load").json() == {"server_load": 0}
        with http.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 40,
                                                          "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            assert http.get("/load").json() == {"server_load": 1}
            rest = list(lines)
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
        for _ in range(100):  # the count drops once the response is sent
            if http.get("/load").json()["server_load"] == 0:
                break
        assert http.get("/load").json() == {"server_load": 0}
        # an error answer counts down too: one raised in the route, after the count went up
        # (a body refused by validation, max_tokens 0 say, never reaches the route's count)
        assert http.post("/v1/completions", json={**BODY, "model": "gpt-5"}).status_code == 404
        assert http.get("/load").json() == {"server_load": 0}
    assert build_app(llm, model_name=MODEL).url_path_for  # /load only with the flag:
    assert post(build_app(llm, model_name=MODEL), "/load", {}).status_code in (404, 405)


def test_sse_keepalive_comments_fill_silence_and_keep_the_pending_read():
    closed = []

    async def slow():
        try:
            yield "data: 1\n\n"
            await asyncio.sleep(0.35)
            yield "data: 2\n\n"
        finally:
            closed.append(True)

    async def go():
        return [item async for item in load_tracking.sse_with_keepalive(slow(), 0.1)]

    items = asyncio.run(go())
    assert items[0] == "data: 1\n\n" and items[-1] == "data: 2\n\n"
    assert set(items[1:-1]) == {": keepalive\n\n"} and 2 <= len(items) - 2 <= 4
    assert closed == [True]
    with pytest.raises(ValueError, match="must be positive"):
        asyncio.run(anext(load_tracking.sse_with_keepalive(slow(), 0)))


def test_log_error_stack_logs_the_traceback_of_an_error_answer(llm, caplog):
    bad = {**BODY, "max_tokens": -1}
    with caplog.at_level(logging.ERROR, logger="workbench.entrypoints.openai"):
        assert post(build_app(llm, model_name=MODEL), "/v1/completions", bad).status_code == 400
        assert not [r for r in caplog.records if r.exc_info]
        app = build_app(llm, model_name=MODEL, log_error_stack=True)
        assert post(app, "/v1/completions", bad).status_code == 400
    assert [r for r in caplog.records if r.exc_info and "error response 400" in r.getMessage()]


def test_check_health_configs_and_collective_rpc():
    llm = AsyncLLM(LLMEngine(device="cpu", block_size=8, num_kv_blocks=24))

    async def go():
        await llm.check_health()
        assert (await llm.get_vllm_config()).num_kv_blocks == 24
        assert (await llm.get_model_config()).architecture == "LlamaForCausalLM"
        assert (await llm.get_tokenizer()).eos_token_id is not None
        # the one worker is the runner: its own answer, as a list of one
        blocks = await llm.collective_rpc("determine_num_blocks", kwargs=dict(
            num_kv_blocks=5, kv_cache_memory_bytes=0, gpu_memory_utilization=0.5,
            max_num_batched_tokens=8))
        assert blocks == [5]
        with pytest.raises(AttributeError, match="no public method 'nope'"):
            await llm.collective_rpc("nope")
        await llm.shutdown()
        with pytest.raises(EngineDeadError):
            await llm.check_health()

    asyncio.run(go())
