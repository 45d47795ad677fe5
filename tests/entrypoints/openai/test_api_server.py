"""The OpenAI-compatible server: AsyncLLM's background engine thread and the FastAPI app.

References are independent of the server: transformers' greedy ``generate`` and
``log_softmax`` on the same weights, the Hugging Face tokenizer, hand-written expectations
for SSE framing and error shapes, and the KV pool's free-block count for aborts.
"""

import asyncio
import json
import re
import threading
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from workbench import LLMEngine, SamplingParams
from workbench.engine.async_llm import AsyncLLM, EngineDeadError
from workbench.entrypoints.openai.api_server import build_app


from serving_support import (
    GOOD, KEY, MODEL, NUM_BLOCKS, client, drive_asgi, greedy_ids, hf, num_free_blocks, serving_fixtures,
    sse_events, steps_that_ran, uvicorn_server, wait_all_free,
)


async_llm, app = serving_fixtures()


@pytest.fixture(scope="module")
def keyed_app(async_llm):
    return build_app(async_llm, model_name=MODEL, api_key=KEY)


# ---------------------------------------------------------------------------- generation
def test_greedy_completion_and_chat_equal_transformers(app, hf):
    model, tok = hf
    n = 12
    prompt = "JULIET:\nO Romeo, Romeo!"
    messages = [{"role": "user", "content": "Good morrow, sweet lady."}]
    ref_text = tok.decode(greedy_ids(model, tok(prompt).input_ids, n), skip_special_tokens=True)
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"]
    ref_chat = tok.decode(greedy_ids(model, chat_ids, n), skip_special_tokens=True)

    async def go():
        async with client(app) as c:
            return await asyncio.gather(
                c.post("/v1/completions", json={**GOOD, "prompt": prompt, "max_tokens": n}),
                c.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": messages, "max_completion_tokens": n,
                    "temperature": 0, "ignore_eos": True}),
            )

    comp, chat = asyncio.run(go())
    assert comp.status_code == 200 and chat.status_code == 200
    body = comp.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    assert body["choices"][0]["text"] == ref_text
    assert body["choices"][0]["finish_reason"] == "length"
    prompt_len = len(tok(prompt).input_ids)
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": n,
                             "total_tokens": prompt_len + n}
    cbody = chat.json()
    assert cbody["object"] == "chat.completion"
    assert cbody["choices"][0]["message"] == {"role": "assistant", "content": ref_chat,
                                              "tool_calls": []}  # vLLM's shape
    assert cbody["usage"]["prompt_tokens"] == len(chat_ids)


def test_streaming_completion_concatenates_to_full_text(app):
    async def go():
        async with client(app) as c:
            full = await c.post("/v1/completions", json=GOOD)
            streamed = await c.post("/v1/completions", json={
                **GOOD, "stream": True, "stream_options": {"include_usage": True}})
            return full, streamed

    full, streamed = asyncio.run(go())
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(streamed.text)
    *text_chunks, usage_chunk = chunks
    assert len(text_chunks) >= 2  # streamed, not one blob
    assert all(ch["object"] == "text_completion" for ch in chunks)
    assert len({ch["id"] for ch in chunks}) == 1
    text = "".join(ch["choices"][0]["text"] for ch in text_chunks)
    assert text == full.json()["choices"][0]["text"]
    assert [ch["choices"][0]["finish_reason"] for ch in text_chunks][-1] == "length"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == full.json()["usage"]
    assert usage_chunk["usage"]["completion_tokens"] == 8


def test_chat_streaming_first_chunk_carries_role(app):
    req = {"model": MODEL, "messages": [{"role": "user", "content": "Who art thou?"}],
           "max_tokens": 6, "temperature": 0, "ignore_eos": True}

    async def go():
        async with client(app) as c:
            return await asyncio.gather(
                c.post("/v1/chat/completions", json=req),
                c.post("/v1/chat/completions", json={**req, "stream": True}),
            )

    full, streamed = asyncio.run(go())
    chunks = sse_events(streamed.text)
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in ch["choices"][0]["delta"] for ch in chunks[1:])
    content = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
    assert content == full.json()["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in ch for ch in chunks)  # include_usage not asked: left out


def test_n2_seed_and_stop_strings(app, hf):
    model, tok = hf
    sampled = {**GOOD, "n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 10}

    async def go():
        async with client(app) as c:
            return await asyncio.gather(
                c.post("/v1/completions", json=sampled),
                c.post("/v1/completions", json=sampled),
                c.post("/v1/completions", json={**sampled, "stream": True}),
            )

    first, again, streamed = asyncio.run(go())
    choices = first.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert first.json()["usage"]["completion_tokens"] == 20
    assert [c["text"] for c in again.json()["choices"]] == [c["text"] for c in choices]
    per_index = {0: "", 1: ""}
    for ch in sse_events(streamed.text):
        for c in ch["choices"]:
            per_index[c["index"]] += c["text"]
    assert [per_index[0], per_index[1]] == [c["text"] for c in choices]

    # Stop string: cut the greedy reference text at its first newline after a word.
    greedy = tok.decode(greedy_ids(model, tok("ROMEO:").input_ids, 20), skip_special_tokens=True)
    stop = " my"
    assert stop in greedy, greedy
    r = asyncio.run(_post(app, "/v1/completions", {**GOOD, "max_tokens": 20, "stop": [stop]}))
    choice = r.json()["choices"][0]
    assert choice["text"] == greedy[: greedy.index(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    r = asyncio.run(_post(app, "/v1/completions", {**GOOD, "max_tokens": 20, "echo": True}))
    assert r.json()["choices"][0]["text"] == "ROMEO:" + greedy


async def _post(app, path, body, **kw):
    async with client(app) as c:
        return await c.post(path, json=body, **kw)


def test_logprobs_shapes_and_values(app, hf):
    model, tok = hf
    prompt_ids = tok("ROMEO:").input_ids
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0, -1], -1)
    ref_top = ref.topk(2)

    async def go():
        async with client(app) as c:
            return await asyncio.gather(
                c.post("/v1/completions", json={**GOOD, "max_tokens": 5, "logprobs": 2}),
                c.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "Speak."}],
                    "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                    "logprobs": True, "top_logprobs": 3}),
            )

    comp, chat = asyncio.run(go())
    lp = comp.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == comp.json()["choices"][0]["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    first_id = int(ref_top.indices[0])
    assert lp["tokens"][0] == tok.decode([first_id])
    assert lp["token_logprobs"][0] == pytest.approx(float(ref[first_id]), abs=1e-4)
    top0 = lp["top_logprobs"][0]
    assert list(top0.values()) == pytest.approx(ref_top.values.tolist(), abs=1e-4)
    for tokens_top, chosen in zip(lp["top_logprobs"], lp["token_logprobs"]):
        assert len(tokens_top) == 2 and max(tokens_top.values()) == pytest.approx(chosen)

    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert len(entry["top_logprobs"]) == 3
        assert entry["bytes"] == list(entry["token"].encode())
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: rank 1
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert values == sorted(values, reverse=True) and values[0] <= 0.0


# ---------------------------------------------------------------------------- errors
ERRORS = [
    ("temperature", {**GOOD, "temperature": -0.5}, 400, "temperature must be non-negative", "temperature"),
    ("context", {**GOOD, "prompt": "word " * 1100}, 400, "maximum context length is 1024 tokens", "prompt"),
    ("max_tokens", {**GOOD, "max_tokens": 5000}, 400, "'max_tokens' or 'max_completion_tokens' is too large: 5000", "max_tokens"),
    ("bad_type", {**GOOD, "top_k": "many"}, 400, "top_k: Input should be a valid integer", "top_k"),
    ("model", {**GOOD, "model": "gpt-5"}, 404, "The model `gpt-5` does not exist.", "model"),
]


async def _wait_in_flight(async_llm, timeout: float = 10.0) -> None:
    """Poll until the engine has a request in flight."""
    deadline = time.monotonic() + timeout
    while not await async_llm.call_utility("has_unfinished_requests"):
        assert time.monotonic() < deadline, "the request never reached the engine"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("case", ERRORS, ids=[e[0] for e in ERRORS])
def test_error_does_not_disturb_request_in_flight(app, async_llm, case):
    """The bad request is sent once the stream is in the engine and answered while it still
    runs (before, the stream could start after the error or end before it); the stream then
    runs to its max_tokens."""
    _, body, status, message, param = case
    long = {**GOOD, "max_tokens": 300, "stream": True, "stream_options": {"include_usage": True}}

    async def go():
        async with client(app) as c:
            good = asyncio.create_task(c.post("/v1/completions", json=long))
            await _wait_in_flight(async_llm)
            bad = await c.post("/v1/completions", json=body)
            still_running = await async_llm.call_utility("has_unfinished_requests")
            return bad, still_running, await good

    bad, still_running, good = asyncio.run(go())
    assert still_running, "the stream ended before the error was answered"
    assert bad.status_code == status
    err = bad.json()
    assert set(err) == {"error"}  # vLLM V1's ErrorResponse: no top-level "object"
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert message in err["error"]["message"]
    assert err["error"]["code"] == status and err["error"]["param"] == param
    *chunks, usage = sse_events(good.text)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["usage"]["completion_tokens"] == 300


def test_malformed_json_is_400(app):
    async def go():
        async with client(app) as c:
            good = asyncio.create_task(c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hail."}], "max_tokens": 4}))
            bad = await c.post("/v1/completions", content=b'{"prompt": "ROMEO:", ',
                               headers={"content-type": "application/json"})
            missing = await c.post("/v1/chat/completions", json={"model": MODEL})
            return bad, missing, await good

    bad, missing, good = asyncio.run(go())
    assert bad.status_code == 400 and "Malformed JSON" in bad.json()["error"]["message"]
    assert missing.status_code == 400
    assert missing.json()["error"]["param"] == "messages"
    assert "messages: Field required" in missing.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["role"] == "assistant"


def test_api_key(keyed_app):
    async def go():
        async with client(keyed_app) as c:
            good = asyncio.create_task(c.post(
                "/v1/completions", json=GOOD, headers={"Authorization": f"Bearer {KEY}"}))
            wrong = await c.post("/v1/completions", json=GOOD,
                                 headers={"Authorization": "Bearer nope"})
            missing = await c.get("/v1/models")
            health = await c.get("/health")  # not guarded
            return wrong, missing, health, await good

    wrong, missing, health, good = asyncio.run(go())
    assert wrong.status_code == 401 and missing.status_code == 401
    assert wrong.json()["error"]["type"] == "AuthenticationError"
    assert health.status_code == 200
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 8


def test_async_llm_validation_error_propagates(async_llm):
    async def go():
        # long enough to be still in flight while the two bad requests are processed
        ok = async_llm.generate("HAMLET:", SamplingParams(temperature=0, max_tokens=100,
                                                           ignore_eos=True), "ok-1")
        first = await ok.__anext__()
        with pytest.raises(ValueError, match=r"The decoder prompt \(length 1024\) plus the number of "
                                             r"requested output tokens \(at least 1\)"):  # the engine's (V1)
            await async_llm.add_request({"prompt_token_ids": [5] * 1024}, SamplingParams(), "bad-1")
        # an id in flight is served too, as vLLM V1's AsyncLLM: under a suffixed id
        twin = await async_llm.add_request("x", SamplingParams(max_tokens=2), "ok-1")
        rest = [out async for out in ok]
        twin_outs = [out async for out in twin]
        return [first, *rest], twin, twin_outs

    outs, twin, twin_outs = asyncio.run(go())
    assert re.fullmatch(r"ok-1-[0-9a-f]{8}", twin.request_id), twin.request_id
    assert twin_outs[-1].finished and len(twin_outs[-1].outputs[0].token_ids) == 2
    # default params: CUMULATIVE outputs, as vLLM's AsyncLLM gives them (the last holds all)
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 100


# ---------------------------------------------------------------------------- concurrency
def test_concurrent_streams_complete_and_free_blocks(app, async_llm):
    prompts = ["ROMEO:", "JULIET:", "HAMLET:\nTo be, or not to be", "LEAR:", "PUCK:"]

    async def go():
        async with client(app) as c:
            responses = await asyncio.gather(*(
                c.post("/v1/completions", json={**GOOD, "prompt": p, "max_tokens": 6 + i,
                                                "stream": True})
                for i, p in enumerate(prompts)))
            await wait_all_free(async_llm)
            return responses

    for i, r in enumerate(asyncio.run(go())):
        chunks = sse_events(r.text)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len({ch["id"] for ch in chunks}) == 1


def test_consumer_leaving_aborts_and_frees_blocks(async_llm):
    """A consumer that leaves after its first output ends its request then: it ran a few
    steps of its 400 (run to the end, as without the abort, it would free its blocks too)."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def go():
        # 1) break out of the iteration (and close the generator)
        gen = async_llm.generate("ROMEO:" * 30, params, "leave-break")
        async for _ in gen:
            break
        assert await num_free_blocks(async_llm) < NUM_BLOCKS  # it holds blocks now
        await gen.aclose()
        await wait_all_free(async_llm)

        # 2) cancel the task that iterates
        got_one = asyncio.Event()

        async def consume():
            async for _ in async_llm.generate("JULIET:" * 30, params, "leave-cancel"):
                got_one.set()

        task = asyncio.create_task(consume())
        await got_one.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_all_free(async_llm)
        history = await async_llm.get_history()
        return [steps_that_ran(history, rid) for rid in ("leave-break", "leave-cancel")]

    ran = asyncio.run(go())
    assert all(1 <= n < 50 for n in ran), ran


def test_abort_from_outside_ends_the_stream_with_abort(async_llm):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def go():
        stream = await async_llm.add_request("ROMEO:", params, "outside-abort")
        await stream.__anext__()
        async_llm.abort("outside-abort")
        outs = [out async for out in stream]  # ends: the final output is the abort
        assert outs and outs[-1].finished
        assert outs[-1].outputs[0].finish_reason == "abort"
        await wait_all_free(async_llm)

    asyncio.run(asyncio.wait_for(go(), 30))


def _aborted_count(metrics_text):
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "vllm:request_success":
            return sum(s.value for s in family.samples
                       if s.name.endswith("_total") and s.labels["finished_reason"] == "abort")
    raise AssertionError("no vllm:request_success metric")


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "api_key_middleware"])
def test_http_client_disconnect_aborts_request(app, keyed_app, async_llm, keyed):
    long = {**GOOD, "prompt": "OTHELLO:" * 20, "max_tokens": 400}
    app = keyed_app if keyed else app
    headers = {"Authorization": f"Bearer {KEY}"}

    async def go():
        async with client(app, headers=headers) as c:
            before = _aborted_count((await c.get("/metrics")).text)
        streamed = await drive_asgi(app, {**long, "stream": True}, disconnect_after_chunks=2)
        await wait_all_free(async_llm)
        await drive_asgi(app, long, disconnect_after_chunks=0)  # non-streaming
        await wait_all_free(async_llm)
        # gone while the response head is being sent: the body generator never starts
        await drive_asgi(app, {**long, "stream": True}, 0, hang_on_start=True)
        await wait_all_free(async_llm)
        async with client(app, headers=headers) as c:
            after = _aborted_count((await c.get("/metrics")).text)
        return streamed, after - before

    streamed, aborted = asyncio.run(go())
    assert 2 <= len(streamed) < 400 and b"[DONE]" not in b"".join(streamed)
    assert aborted == 3


# ---------------------------------------------------------------------------- other endpoints
def _samples(text):
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_tokenize_models(app, hf):
    _, tok = hf
    labels = (("model_name", MODEL),)

    async def go():
        async with client(app) as c:
            before = _samples((await c.get("/metrics")).text)
            done = await c.post("/v1/completions", json={**GOOD, "prompt": "LEAR:", "max_tokens": 5})
            after = _samples((await c.get("/metrics")).text)
            toks = await c.post("/tokenize", json={"model": MODEL, "prompt": "ROMEO: good night"})
            plain = await c.post("/tokenize", json={"prompt": "ROMEO: good night",
                                                    "add_special_tokens": False})
            text = await c.post("/detokenize", json={"tokens": plain.json()["tokens"]})
            chat = await c.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
            bad = await c.post("/detokenize", json={"tokens": [10**9]})
            models = await c.get("/v1/models")
            return before, done, after, toks, plain, text, chat, bad, models

    before, done, after, toks, plain, text, chat, bad, models = asyncio.run(go())
    assert done.status_code == 200

    def delta(name, extra=()):
        key = (name, tuple(sorted(labels + extra)))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:prompt_tokens_total") == len(tok("LEAR:").input_ids)
    assert delta("vllm:request_success_total", (("finished_reason", "length"),)) == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert (f"vllm:{gauge}", labels) in after

    ids = tok("ROMEO: good night").input_ids
    assert toks.json() == {"tokens": ids, "count": len(ids), "max_model_len": 1024}
    assert plain.json()["tokens"] == tok("ROMEO: good night", add_special_tokens=False).input_ids
    assert text.json() == {"prompt": "ROMEO: good night"}
    chat_ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True,
                                       add_generation_prompt=True, return_dict=True)["input_ids"]
    assert chat.json()["tokens"] == chat_ids
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert [m["id"] for m in models.json()["data"]] == [MODEL]
    assert models.json()["object"] == "list"


def test_uvicorn_serves_on_a_free_port(app):
    with uvicorn_server(app) as base_url, httpx.Client(base_url=base_url, timeout=20) as c:
        assert c.get("/health").status_code == 200
        with c.stream("POST", "/v1/completions", json={**GOOD, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
            assert r.headers["x-request-id"]
    assert lines[-1] == "data: [DONE]"


def test_shutdown_and_engine_failure_fail_streams_and_health():
    engine = LLMEngine(device="cpu", block_size=8, num_kv_blocks=16)
    params = SamplingParams(max_tokens=100, ignore_eos=True)

    async def shutdown_case():
        llm = AsyncLLM(engine)
        app = build_app(llm, model_name=MODEL)
        stream = await llm.add_request("ROMEO:", params, "s")
        await stream.__anext__()
        await llm.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await llm.add_request("ROMEO:", SamplingParams(), "s2")
        async with client(app) as c:
            return await c.get("/health"), await c.post("/v1/completions", json=GOOD)

    health, comp = asyncio.run(shutdown_case())
    assert health.status_code == 503 and comp.status_code == 503
    assert comp.json()["error"]["type"] == "ServiceUnavailableError"
    # shutdown aborted the request in flight: the engine is clean for the next owner
    assert not engine.has_unfinished_requests() and engine.kv_cache.num_free_blocks == 16

    def broken_step():
        raise RuntimeError("device fell over")

    engine.step = broken_step  # the instance attribute shadows LLMEngine.step

    async def failure_case():
        llm = AsyncLLM(engine)
        app = build_app(llm, model_name=MODEL)
        async with client(app) as c:
            streamed = await c.post("/v1/completions", json={**GOOD, "stream": True})
            health = await c.get("/health")
        return streamed, health

    streamed, health = asyncio.run(failure_case())
    *events, done = streamed.text.split("\n\n")[:-1]
    assert done == "data: [DONE]"
    error = json.loads(events[-1][len("data: "):])["error"]
    assert error["code"] == 503 and "device fell over" in error["message"]
    assert health.status_code == 503 and "device fell over" in health.json()["error"]["message"]


def test_cli_serve_defaults_bind_localhost():
    from workbench.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert args.func.__name__ == "_serve"
    args = build_parser().parse_args(["serve", "--port", "9000", "--api-key", "k", "--num-kv-blocks", "32"])
    assert (args.port, args.api_key, args.num_kv_blocks) == (9000, "k", 32)


def test_server_exits_when_the_engine_dies():
    from workbench.entrypoints.openai.api_server import make_server

    engine = LLMEngine(device="cpu", block_size=8, num_kv_blocks=16)
    llm = AsyncLLM(engine)
    server = make_server(build_app(llm, model_name=MODEL), llm, host="127.0.0.1", port=0,
                         log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]

    def broken_step():
        raise RuntimeError("device fell over")

    engine.step = broken_step
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=20) as c:
        streamed = c.post("/v1/completions", json={**GOOD, "stream": True})
    assert "device fell over" in streamed.text and streamed.text.endswith("data: [DONE]\n\n")
    thread.join(timeout=20)
    assert not thread.is_alive()  # uvicorn returned: the process would exit


def test_async_llm_and_stream_reprs(async_llm):
    async def go():
        stream = await async_llm.add_request("ROMEO:", SamplingParams(max_tokens=2), "repr-1")
        before = repr(stream)
        outs = [out async for out in stream]
        return before, repr(stream), outs

    before, after, outs = asyncio.run(go())
    assert before == "RequestStream(request_id='repr-1', open)"
    assert after == "RequestStream(request_id='repr-1', finished)" and outs[-1].finished
    assert repr(async_llm).startswith("AsyncLLM(running=") and "alive=True" in repr(async_llm)
    assert "engine thread" in async_llm._repr_html_()
