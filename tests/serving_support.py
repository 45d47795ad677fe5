"""Helpers shared by the serving tests: one engine per test module, an ASGI client, SSE
parsing checked by hand, waiting for every KV block to be free, a uvicorn server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from unittest import mock

import httpx
import pytest
import torch
import transformers

from workbench import LLMEngine, default_model_path
from workbench.config import EngineArgs
from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.openai.api_server import build_app

MODEL = "tiny-shakespeare"
KEY = "sesame"
NUM_BLOCKS = 64
GOOD = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def serving_fixtures(num_blocks: int = NUM_BLOCKS, engine: dict | None = None,
                     multiprocess: bool = False, **app_options):
    """Module-scoped ``async_llm`` (an engine of ``num_blocks`` KV blocks of 8 tokens and the
    ``engine`` options, shut down after the module; ``multiprocess``: its core in a child
    process, started once for the module) and ``app`` fixtures (``build_app`` with
    ``app_options``): ``async_llm, app = serving_fixtures()``."""

    @pytest.fixture(scope="module")
    def async_llm():
        options = dict(device="cpu", block_size=8, num_kv_blocks=num_blocks, **(engine or {}))
        if multiprocess:  # small output chunks: concurrent streams cross chunk boundaries
            with mock.patch.dict(os.environ, {"VLLM_V1_OUTPUT_PROC_CHUNK_SIZE": "2"}):
                llm = AsyncLLM.from_engine_args(EngineArgs(multiprocess_mode=True, **options))
        else:
            llm = AsyncLLM(LLMEngine(**options))
        yield llm
        asyncio.run(llm.shutdown())
        if multiprocess:
            assert llm._client.proc.poll() is not None  # the core process is gone
        else:
            assert not llm._thread.is_alive()

    @pytest.fixture(scope="module")
    def app(async_llm):
        return build_app(async_llm, model_name=MODEL, **app_options)

    return async_llm, app


@pytest.fixture(scope="module")
def hf():
    """transformers' model and tokenizer on the same weights: the independent reference."""
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(path)


def greedy_ids(model, prompt_ids, n) -> list[int]:
    """transformers' greedy continuation of exactly ``n`` tokens (eos does not stop it)."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, eos_token_id=None)
    new = out[0, len(prompt_ids):].tolist()
    assert len(new) == n
    return new


def client(app, **kw) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", **kw)


def sse_events(body: str) -> list:
    """Split an SSE body into its data payloads (JSON-decoded), checking the framing by hand."""
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = body.split("\n\n")
    assert events[-1] == ""
    payloads = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        payloads.append(event[len("data: "):])
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


async def num_free_blocks(async_llm) -> int:
    return await async_llm.call_utility("get_num_free_blocks")


def steps_that_ran(history, request_id: str) -> int:
    """How many steps of an engine's ``history`` scheduled ``request_id``."""
    return sum(any(c.request_id == request_id for c in record.scheduler_output.scheduled)
               for record in history)


async def wait_all_free(async_llm, timeout: float = 10.0, num_blocks: int = NUM_BLOCKS) -> None:
    """Poll (between two steps, in process or in the core process) until no request is in
    flight and every block is free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = await async_llm.call_utility("has_unfinished_requests")
        free = await async_llm.call_utility("get_num_free_blocks")
        if not busy and free == num_blocks:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks not freed: {free}/{num_blocks} free, busy={busy}")


async def drive_asgi(app, body, disconnect_after_chunks, hang_on_start=False,
                     path="/v1/completions"):
    """Call the ASGI app directly; the client disconnects after N response body chunks
    (``hang_on_start``: sending the response head never completes, as on a dead socket)."""
    chunks, sent_body = [], False
    enough = asyncio.Event()
    if disconnect_after_chunks == 0:
        enough.set()

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await enough.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if hang_on_start and message["type"] == "http.response.start":
            await asyncio.Event().wait()
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
        if len(chunks) >= disconnect_after_chunks:
            enough.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"),
                         (b"authorization", f"Bearer {KEY}".encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await asyncio.wait_for(app(scope, receive, send), timeout=30)
    return chunks


@contextlib.contextmanager
def uvicorn_server(app):
    """Serve ``app`` on 127.0.0.1 (a free port) in a thread; yields its base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert not thread.is_alive()


def call(app, fn):
    """``await fn(client)`` with the official ``openai`` client talking to ``app`` in process."""
    import openai

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test/v1") as http:
            api = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none",
                                     http_client=http, max_retries=0)
            return await fn(api)
    return asyncio.run(go())
