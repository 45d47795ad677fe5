"""The serving tests again with the engine core in a child process (``multiprocess_mode``, one
core process for the module): chat and completions, streamed and whole, against
transformers; error bodies; aborts when a consumer or an HTTP client leaves (blocks freed,
/metrics counting them from the stats the core ships); the official ``openai`` client. Then
an adapter loads in the core, the records come back whole, and killing the core mid-stream is survived as vLLM does:
open streams end with an error event then ``[DONE]``, the server stops (``make_server``),
``/health`` and new requests answer 503, nothing hangs. (The kill is this module's last test: it ends the module's core.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from workbench import LoRARequest, SamplingParams
from workbench.engine.history import StepHistory
from workbench.model.loader import embedded_lora_path
from workbench.engine.request_output_collector import RequestOutputCollector
from workbench.engine.serial_utils import EngineCoreOutputs
from workbench.outputs import CompletionOutput, RequestOutput
from workbench.sampling_params import RequestOutputKind
from workbench.entrypoints.openai.api_server import build_app, make_server

from serving_support import GOOD, KEY, MODEL, call, client, hf, serving_fixtures  # noqa: F401
from test_api_server import (  # noqa: F401  (collected here again, on this module's fixtures)
    test_abort_from_outside_ends_the_stream_with_abort,
    test_async_llm_validation_error_propagates, test_chat_streaming_first_chunk_carries_role,
    test_concurrent_streams_complete_and_free_blocks, test_consumer_leaving_aborts_and_frees_blocks,
    test_error_does_not_disturb_request_in_flight, test_greedy_completion_and_chat_equal_transformers,
    test_http_client_disconnect_aborts_request, test_malformed_json_is_400,
    test_streaming_completion_concatenates_to_full_text)
from test_lora_http import peft_text
from test_openai_client import (  # noqa: F401
    test_chat_shapes_and_stream, test_completion_stream_with_usage,
    test_errors_map_to_the_clients_exceptions)
from test_serving_validation import (  # noqa: F401  (a 400 beside streams in flight)
    test_errors_while_streams_run_leave_them_intact)
from test_serving_rules import (  # noqa: F401
    test_cache_salt_is_honoured_and_checked_as_vllm, test_null_max_tokens_is_sixteen_and_null_flags_are_their_defaults,
    test_return_token_ids_completions_whole_and_streamed)
from test_serving_layer import (  # noqa: F401  (the serving layer's flags, the stats from the core)
    test_load_tracking_counts_a_stream_until_it_ends, test_orca_metrics_header_in_text_and_json,
    test_request_logger_cuts_prompts_to_max_log_len)

async_llm, app = serving_fixtures(multiprocess=True, engine={"enable_lora": True})


@pytest.fixture(scope="module")
def llm(async_llm):
    """test_serving_layer's name for the module's engine."""
    return async_llm


@pytest.fixture(scope="module")
def keyed_app(async_llm):
    return build_app(async_llm, model_name=MODEL, api_key=KEY)


@pytest.fixture(scope="module")
def server(keyed_app, async_llm):
    """``make_server`` on 127.0.0.1 in a thread (it stops when the core dies): (URL, thread)."""
    server = make_server(keyed_app, async_llm, host="127.0.0.1", port=0, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", thread
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def served(server):
    return server[0]


@pytest.fixture(scope="module")
def api(served):
    return openai.OpenAI(base_url=f"{served}/v1", api_key=KEY, max_retries=0, timeout=30)


def test_the_core_runs_in_a_child_process(async_llm):
    assert async_llm.multiprocess_mode and async_llm.engine is None
    assert async_llm._client.proc.pid != os.getpid() and async_llm.is_running
    assert "multiprocess_mode=True" in repr(async_llm)


def test_outputs_reach_their_loops_a_chunk_at_a_time(async_llm):
    """VLLM_V1_OUTPUT_PROC_CHUNK_SIZE=2 here: 5 outputs are 3 callbacks on their loop."""
    calls = []

    class Loop:  # records what the output handler schedules
        def call_soon_threadsafe(self, fn, items):
            calls.append((fn, items))

    collectors = {f"chunk-{i}": RequestOutputCollector(RequestOutputKind.DELTA, f"chunk-{i}")
                  for i in range(5)}
    outputs = [RequestOutput(rid, "p", [1], [CompletionOutput(0, "x", [2], None, None)], True)
               for rid in collectors]
    with async_llm._lock:
        loop = Loop()
        async_llm._streams.update({rid: (loop, c) for rid, c in collectors.items()})
    async_llm._handle_core_outputs(EngineCoreOutputs(outputs=outputs))
    assert [len(items) for _, items in calls] == [2, 2, 1]
    for fn, items in calls:
        fn(items)
    assert [c.get_nowait() for c in collectors.values()] == outputs
    assert not set(collectors) & set(async_llm._streams)  # finished: unregistered


def test_a_lora_adapter_loads_in_the_core_and_serves(async_llm):
    """add_lora crosses as a utility call; the adapter's greedy text equals transformers +
    PEFT's on the same weights."""
    lora = LoRARequest("errors", 1, str(embedded_lora_path("errors")))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def go():
        assert await async_llm.call_utility("add_lora", lora)
        outs = [o async for o in async_llm.generate("ADRIANA:", params, "lora-1", lora_request=lora)]
        return outs[-1].outputs[0].text, await async_llm.call_utility("list_loras")

    text, loaded = asyncio.run(go())
    assert loaded == {1}
    assert text == peft_text(str(embedded_lora_path("errors")), "ADRIANA:", 8)


def test_health_configs_and_collective_rpc_reach_the_core(async_llm):
    async def go():
        await async_llm.check_health()
        assert (await async_llm.get_vllm_config()).multiprocess_mode
        assert (await async_llm.get_model_config()).architecture == "LlamaForCausalLM"
        # the one worker, the core's runner, answers over the socket
        assert await async_llm.collective_rpc("determine_num_blocks", kwargs=dict(
            num_kv_blocks=5, kv_cache_memory_bytes=0, gpu_memory_utilization=0.5,
            max_num_batched_tokens=8)) == [5]
        with pytest.raises(AttributeError, match="no public method"):
            await async_llm.collective_rpc("_private")
    asyncio.run(go())


def test_the_records_come_back_whole(async_llm, api):
    before = len(asyncio.run(async_llm.get_history()))
    out = api.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=5, temperature=0,
                                 extra_body={"ignore_eos": True})
    history = asyncio.run(async_llm.get_history())
    assert isinstance(history, StepHistory) and len(history) > before
    sampled = [t for record in list(history)[before:] for ids in record.sampled_token_ids.values()
               for t in ([ids] if isinstance(ids, int) else ids)]
    assert len(sampled) == out.usage.completion_tokens == 5
    assert len(history.to_dataframe()) == len(history)


def test_killing_the_core_mid_stream_ends_streams_and_answers_503(async_llm, app, api, server):
    """Last in the module: it kills the module's core process."""
    served, thread = server
    long = {**GOOD, "prompt": "OTHELLO:", "max_tokens": 300, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=served, headers=headers, timeout=30) as http, \
            http.stream("POST", "/v1/completions", json=long) as raw:
        chat = api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Speak."}], max_tokens=300,
            stream=True, extra_body={"ignore_eos": True})
        lines = raw.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first[len("data: "):])["choices"]
        next(iter(chat))
        start = time.monotonic()
        os.kill(async_llm._client.proc.pid, signal.SIGKILL)
        rest = [line for line in lines if line]
        with pytest.raises(openai.APIError, match="died unexpectedly"):
            for _ in chat:
                pass
    thread.join(timeout=20)  # make_server stops serving once the engine is dead, as vLLM's
    assert not thread.is_alive()
    assert time.monotonic() - start < 20  # nothing waited for the dead core

    async def ask(c):  # the app itself still answers, in process
        async with client(app) as http:
            health = await http.get("/health")
        with pytest.raises(openai.InternalServerError) as refused:
            await c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=2)
        return health, refused

    health, refused = call(app, ask)
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["code"] == 503 and "died unexpectedly" in error["message"]
    assert health.status_code == 503 and "died unexpectedly" in health.json()["error"]["message"]
    assert refused.value.status_code == 503
    assert not async_llm.is_running and "exit code -9" in str(async_llm.dead_error)
