"""The engine core in a child process (SyncMPClient over ZMQ) gives the same outputs and the
same step records as the in-process engine; what crosses the socket round-trips exactly; a
killed core is detected at once (EngineDeadError), nothing waits for it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from workbench import LLMEngine, SamplingParams
from workbench.config import EngineConfig
from workbench.engine.core_client import EngineCoreClient, InprocClient, SyncMPClient
from workbench.engine.exceptions import EngineDeadError
from workbench.engine.history import StepHistory
from workbench.engine.serial_utils import EngineCoreOutputs, MsgpackDecoder, MsgpackEncoder
from workbench.lora.request import LoRARequest
from workbench.outputs import RequestOutput
from workbench.sampling_params import RequestOutputKind, StructuredOutputsParams

CONFIG = EngineConfig(device="cpu", block_size=8, num_kv_blocks=64, max_num_seqs=4)
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo", "HAMLET:\nTo be, or not", "LEAR:"]


def params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0 if i % 2 == 0 else 0.8, seed=i, max_tokens=6 + 3 * i,
                          ignore_eos=True, output_kind=RequestOutputKind.DELTA)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(CONFIG)


@pytest.fixture(scope="module")
def client():
    c = EngineCoreClient.make_client(multiprocess_mode=True, asyncio_mode=False, config=CONFIG)
    assert isinstance(c, SyncMPClient)
    yield c
    c.shutdown()
    assert c.proc.poll() is not None


def run(add, abort, get_output, processor) -> dict[str, RequestOutput]:
    """Add every prompt, read outputs until all finished; DELTAs concatenated per request."""
    for i, p in enumerate(PROMPTS):
        add(processor.process_inputs(f"r{i}", p, params(i)))
    texts: dict[str, list] = {}
    done: set[str] = set()
    while len(done) < len(PROMPTS):
        for out in get_output().outputs:
            text, ids = texts.setdefault(out.request_id, ["", []])[:2]
            texts[out.request_id] = [text + out.outputs[0].text, ids + out.outputs[0].token_ids,
                                     out.outputs[0].finish_reason]
            if out.finished:
                done.add(out.request_id)
    return texts


def test_outputs_and_history_equal_the_in_process_engine(client, engine):
    inproc = InprocClient(engine)
    expected = run(inproc.add_request, inproc.abort_requests, inproc.get_output,
                   engine.input_processor)
    got = run(client.add_request, client.abort_requests, lambda: client.get_output(timeout=30),
              client.input_processor)
    assert got == expected
    assert all(v[2] == "length" for v in got.values())
    history = client.call_utility("get_history")  # the records, shipped whole
    assert isinstance(history, StepHistory)
    # the core stepped as requests arrived (how many steps is timing): every token it
    # sampled is in its records, in order, and nothing else
    sampled: dict[str, list[int]] = {}
    for record in history:
        for rid, ids in record.sampled_token_ids.items():
            sampled.setdefault(rid, []).extend([ids] if isinstance(ids, int) else ids)
    assert sampled == {rid: v[1] for rid, v in got.items()}
    assert list(history.to_dataframe().columns) == list(engine.history.to_dataframe().columns)
    assert client.call_utility("get_num_free_blocks") == 64
    assert not client.call_utility("has_unfinished_requests")


def test_abort_gives_a_final_abort_output_and_frees_blocks(client):
    client.add_request(client.input_processor.process_inputs(
        "long", "OTHELLO:" * 10, SamplingParams(max_tokens=300, ignore_eos=True)))
    client.get_output(timeout=30)
    assert client.call_utility("get_num_free_blocks") < 64
    client.abort_requests(["long"])
    final = None
    while final is None:
        final = next((o for o in client.get_output(timeout=30).outputs if o.finished), None)
    assert final.request_id == "long" and final.outputs[0].finish_reason == "abort"
    assert client.call_utility("get_num_free_blocks") == 64


def test_refusals_and_unknown_utilities_reach_the_caller(client):
    too_long = client.input_processor.process_inputs("big", [5] * 600, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="big"):  # 600 tokens never fit in 64 blocks of 8
        client.add_request(too_long)
    with pytest.raises(ValueError, match="'beams'.*max_tokens=600.*num_blocks=64"):  # a beam search's
        client.call_utility("check_request_fits", "beams", 6, 600)  # check: 605 tokens of K/V
    assert client.call_utility("check_request_fits", "beams", 6, 500) is None
    with pytest.raises(AttributeError, match="no utility method 'engine'"):
        client.call_utility("engine")
    with pytest.raises(ValueError, match="logits_processors"):  # callables cannot be sent
        client.add_request(client.input_processor.process_inputs(
            "cb", "ROMEO:", SamplingParams(logits_processors=[lambda ids, logits: logits])))


def test_requests_and_outputs_round_trip_through_msgpack(engine):
    engine_request = engine.input_processor.process_inputs(
        "x", "ROMEO:", SamplingParams(
            n=2, temperature=0.7, stop=["\n", "lord"], logit_bias={3: 1.5}, logprobs=2,
            output_kind=RequestOutputKind.FINAL_ONLY, bad_words=["king"],
            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
            extra_args={"k": [1, 2]}), priority=0)
    engine_request = engine_request.__class__(**{**engine_request.__dict__,
                                                 "lora_request": LoRARequest("a", 1, "/p"),
                                                 "cache_salt": "s", "arrival_time": 1.5})
    enc, dec = MsgpackEncoder(), MsgpackDecoder()
    back = dec.decode_request(enc.encode_request(engine_request))
    assert back.sampling_params == engine_request.sampling_params
    assert back.sampling_params.stop_strings == ("\n", "lord")
    assert back.lora_request.lora_name == "a" and back.cache_salt == "s"
    assert {k: v for k, v in back.__dict__.items() if k not in ("sampling_params", "lora_request")} \
        == {k: v for k, v in engine_request.__dict__.items() if k not in ("sampling_params", "lora_request")}
    engine.add_request("o", "ROMEO:", SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=1))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert dec.decode_outputs(enc.encode(EngineCoreOutputs(outputs=outs))).outputs == outs


def test_a_killed_core_is_detected_at_once(client):
    client.add_request(client.input_processor.process_inputs(
        "k", "ROMEO:", SamplingParams(max_tokens=300, ignore_eos=True)))
    client.get_output(timeout=30)
    os.kill(client.proc.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="died unexpectedly"):
        while True:
            client.get_output(timeout=10)
    assert time.monotonic() - start < 5
    with pytest.raises(EngineDeadError):
        client.call_utility("get_history")
    with pytest.raises(EngineDeadError):
        client.add_request(client.input_processor.process_inputs("k2", "x", SamplingParams()))


def test_a_core_that_cannot_start_says_why():
    with pytest.raises(RuntimeError, match="failed to start.*no-such-model"):
        SyncMPClient(EngineConfig(model="/no-such-model", device="cpu"))


def test_make_client_shapes():
    with pytest.raises(NotImplementedError):
        EngineCoreClient.make_client(False, True, CONFIG)


def test_the_switches(monkeypatch):
    from workbench.engine.async_llm import output_chunk_size
    from workbench.engine.core_client import multiprocessing_enabled
    from workbench.entrypoints.cli import build_parser
    from workbench.config import EngineArgs

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert not multiprocessing_enabled(False) and multiprocessing_enabled(True)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert multiprocessing_enabled(False)
    args = build_parser().parse_args(["serve", "--multiprocess-mode"])
    assert EngineArgs.from_cli_args(args).multiprocess_mode is True
    assert EngineArgs.from_cli_args(build_parser().parse_args(["serve"])).multiprocess_mode is False
    monkeypatch.setenv("VLLM_V1_OUTPUT_PROC_CHUNK_SIZE", "0")
    with pytest.raises(ValueError, match="VLLM_V1_OUTPUT_PROC_CHUNK_SIZE must be an integer >= 1"):
        output_chunk_size()
    monkeypatch.delenv("VLLM_V1_OUTPUT_PROC_CHUNK_SIZE")
    assert output_chunk_size() == 128


def test_a_step_that_raises_ends_the_core_with_its_last_words(tmp_path):
    """The busy loop's failure path, run in this process: the core answers the ADD, sends
    ``engine_dead`` naming the error as its last message, and exits with status 1."""
    import threading

    import zmq

    from workbench.engine.core_proc import EngineCoreProc
    from workbench.engine.serial_utils import EngineCoreRequestType

    engine = LLMEngine(CONFIG)

    def broken_step():
        raise RuntimeError("device fell over")

    engine.step = broken_step
    ctx = zmq.Context()
    to_core, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_core.bind(f"ipc://{tmp_path}/in")
    from_core.bind(f"ipc://{tmp_path}/out")
    core = EngineCoreProc(engine, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    status = []
    thread = threading.Thread(target=lambda: status.append(core.run()), daemon=True)
    thread.start()
    enc, dec = MsgpackEncoder(), MsgpackDecoder()
    request = engine.input_processor.process_inputs("r", "ROMEO:", SamplingParams(max_tokens=4))
    to_core.send_multipart((EngineCoreRequestType.ADD.value, (7).to_bytes(8, "little"),
                            enc.encode_request(request)))
    messages = []
    while not messages or messages[-1].engine_dead is None:
        assert from_core.poll(30_000), "the core went silent"
        messages.append(dec.decode_outputs(from_core.recv()))
    thread.join(timeout=10)
    assert status == [1]
    assert messages[0].ready is not None  # the handshake first
    assert [m.utility_output.call_id for m in messages if m.utility_output] == [7]
    assert "device fell over" in messages[-1].engine_dead
    to_core.close(linger=0)
    from_core.close(linger=0)
    ctx.term()


def test_shutdown_ends_open_streams_and_the_core_process():
    import asyncio

    import httpx

    from workbench.config import EngineArgs
    from workbench.engine.async_llm import AsyncLLM
    from workbench.entrypoints.openai.api_server import build_app

    llm = AsyncLLM.from_engine_args(EngineArgs(multiprocess_mode=True, **{
        k: getattr(CONFIG, k) for k in ("device", "block_size", "num_kv_blocks", "max_num_seqs")}))
    app = build_app(llm, model_name="m")

    async def go():
        stream = await llm.add_request("ROMEO:", SamplingParams(max_tokens=300, ignore_eos=True), "s")
        await stream.__anext__()
        await llm.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError, match="shut down"):
            await llm.add_request("ROMEO:", SamplingParams(), "s2")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.get("/health")

    health = asyncio.run(asyncio.wait_for(go(), 60))
    assert health.status_code == 503 and llm.dead_error is None  # shut down, no error
    assert llm._client.proc.poll() == 0  # the core left by itself, cleanly
