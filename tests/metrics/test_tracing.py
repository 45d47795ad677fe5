"""OpenTelemetry request spans: attributes equal the request's own metrics (the SDK's in-memory
exporter), the caller's traceparent is continued, and spans reach an OTLP/HTTP receiver on
loopback that decodes them with opentelemetry-proto."""

import asyncio
import http.server
import subprocess
import sys
import threading

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from serving_support import MODEL, client
from workbench import LLMEngine, SamplingParams
from workbench.config import EngineArgs
from workbench.core.request_events import RequestPreempted, RequestResumed, RequestScheduled
from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.openai.api_server import build_app
from workbench.metrics import tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"
ENGINE = dict(device="cpu", block_size=4, num_kv_blocks=12, max_num_batched_tokens=16,
              otlp_traces_endpoint="http://127.0.0.1:9/v1/traces")


@pytest.fixture
def spans(monkeypatch):
    exporter = InMemorySpanExporter()
    monkeypatch.setattr(tracing, "get_span_exporter", lambda endpoint: exporter)
    return exporter


def drain(engine):
    while engine.has_unfinished_requests():
        engine.step()
    engine.tracer.force_flush()


def test_a_span_per_finished_request_with_vllms_attributes_equal_to_its_metrics(spans):
    engine = LLMEngine(**ENGINE)
    params = SamplingParams(temperature=0.5, top_p=0.9, max_tokens=12, ignore_eos=True, seed=1)
    prompts = ["KING HENRY:\nOnce more unto the breach", "HAMLET:\nTo be, or not to be"]
    for i, prompt in enumerate(prompts * 2):
        engine.add_request(f"r{i}", prompt, params, trace_headers={"traceparent": TRACEPARENT} if i == 0 else None)
    engine.add_request("gone", "ROMEO:", params)
    engine.abort_request("gone")
    drain(engine)
    rows = engine.requests_dataframe().set_index("request_id")
    assert rows["num_preemptions"].sum() > 0
    got = {s.attributes["gen_ai.request.id"]: s for s in spans.get_finished_spans()}
    assert sorted(got) == ["r0", "r1", "r2", "r3"]  # the aborted request has no span
    for rid, span in got.items():
        row, a = rows.loc[rid], span.attributes
        assert span.name == "llm_request" and span.kind is SpanKind.SERVER
        assert a["gen_ai.response.model"] == "tiny-shakespeare"
        assert (a["gen_ai.request.temperature"], a["gen_ai.request.top_p"], a["gen_ai.request.max_tokens"],
                a["gen_ai.request.n"]) == (0.5, 0.9, 12, 1)
        assert a["gen_ai.usage.prompt_tokens"] == row["num_prompt_tokens"]
        assert a["gen_ai.usage.completion_tokens"] == row["num_output_tokens"] == 12
        assert a["gen_ai.latency.time_in_queue"] == pytest.approx(row["queue_s"], abs=1e-9)
        assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(row["ttft_s"], abs=1e-9)
        assert a["gen_ai.latency.e2e"] == pytest.approx(row["e2e_s"], abs=1e-9)
        assert a["gen_ai.latency.time_in_model_prefill"] == pytest.approx(row["ttft_s"] - row["queue_s"], abs=1e-9)
        assert a["gen_ai.latency.time_in_model_decode"] == pytest.approx(row["tpot_s"] * 11, abs=1e-9)
        assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(row["e2e_s"] - row["queue_s"], abs=1e-9)
        assert abs((span.end_time - span.start_time) - row["e2e_s"] * 1e9) <= 2
        assert "gen_ai.latency.time_in_model_forward" not in a and not span.events  # not detailed
    assert format(got["r0"].context.trace_id, "032x") == TRACE_ID
    assert format(got["r0"].parent.span_id, "016x") == PARENT_SPAN and got["r0"].parent.is_remote
    assert got["r1"].parent is None and got["r1"].context.trace_id != got["r0"].context.trace_id


def test_detailed_traces_add_each_scheduling_decision_and_the_model_times(spans):
    engine = LLMEngine(**ENGINE, collect_detailed_traces="all")
    prompts = ["KING HENRY:\nOnce more unto the breach", "HAMLET:\nTo be, or not to be"]
    for i, prompt in enumerate(prompts * 2):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    drain(engine)
    names = {RequestScheduled: "scheduled", RequestPreempted: "preempted", RequestResumed: "resumed"}
    preempted = 0
    for span in spans.get_finished_spans():
        rid = span.attributes["gen_ai.request.id"]
        log = [e for e in engine.history.request_log(rid) if type(e) in names]
        assert [e.name for e in span.events] == [names[type(e)] for e in log]
        assert [e.attributes["scheduler.step"] for e in span.events] == [e.step for e in log]
        steps = [engine.history.record(e.step) for e in log if isinstance(e, RequestScheduled)]
        assert span.attributes["gen_ai.latency.time_in_model_forward"] == pytest.approx(
            sum(r.timings["forward"] for r in steps))
        assert span.attributes["gen_ai.latency.time_in_model_execute"] == pytest.approx(
            sum(r.timings["prepare"] + r.timings["forward"] + r.timings["sample"] for r in steps))
        preempted += sum(e.name == "preempted" for e in span.events)
    assert preempted == engine.requests_dataframe()["num_preemptions"].sum() > 0


def test_span_attributes_and_count_follow_vllm_v1(spans):
    """vLLM V1's OutputProcessor.do_tracing (not the V0 seed's create_trace_span): the request
    parameters are set only when truthy (temperature 0 is left out), no num_sequences or
    time_in_scheduler attribute, and one span per finished request state: n > 1 gives a span
    per child, each under the request's own id with the child's n=1."""
    engine = LLMEngine(**ENGINE)
    engine.add_request("greedy", "ROMEO:", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.add_request("pair", "JULIET:", SamplingParams(n=2, temperature=0.8, top_p=0.5, seed=3,
                                                         max_tokens=4, ignore_eos=True))
    drain(engine)
    got = spans.get_finished_spans()
    by_id = {}
    for span in got:
        by_id.setdefault(span.attributes["gen_ai.request.id"], []).append(span.attributes)
    assert sorted((rid, len(v)) for rid, v in by_id.items()) == [("greedy", 1), ("pair", 2)]
    (greedy,) = by_id["greedy"]
    assert "gen_ai.request.temperature" not in greedy  # falsy: left out, as V1
    assert (greedy["gen_ai.request.max_tokens"], greedy["gen_ai.request.n"], greedy["gen_ai.request.top_p"]) == (3, 1, 1.0)
    for child in by_id["pair"]:
        assert (child["gen_ai.request.temperature"], child["gen_ai.request.top_p"],
                child["gen_ai.request.n"], child["gen_ai.usage.completion_tokens"]) == (0.8, 0.5, 1, 4)
    for attributes in (a for v in by_id.values() for a in v):
        assert "gen_ai.usage.num_sequences" not in attributes
        assert "gen_ai.latency.time_in_scheduler" not in attributes


def test_options_are_vllms_flags_and_bad_ones_are_refused():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--otlp-traces-endpoint", "http://collector:4318/v1/traces", "--collect-detailed-traces", "model"]))
    assert (args.otlp_traces_endpoint, args.collect_detailed_traces) == ("http://collector:4318/v1/traces", "model")
    with pytest.raises(ValueError, match="collect_detailed_traces requires `--otlp-traces-endpoint` to be set"):
        EngineArgs(collect_detailed_traces="all")
    with pytest.raises(ValueError, match=r"collect_detailed_traces must be one of \['model', 'worker', 'all'\]"):
        EngineArgs(otlp_traces_endpoint="http://x", collect_detailed_traces="everything")
    engine = LLMEngine(device="cpu", block_size=8, num_kv_blocks=8)
    with pytest.raises(ValueError, match="trace_headers must be a mapping"):
        engine.add_request("r", "ROMEO:", SamplingParams(max_tokens=2), trace_headers={"traceparent": 1})
    assert not engine.has_unfinished_requests() and not engine.is_tracing_enabled()


def test_tracing_off_loads_no_opentelemetry_sdk_and_keeps_no_tracer():
    code = ("import sys\nfrom workbench import LLMEngine, SamplingParams\n"
            "e = LLMEngine(device='cpu', block_size=8, num_kv_blocks=8)\n"
            "e.add_request('r', 'ROMEO:', SamplingParams(max_tokens=2), trace_headers={'traceparent': '%s'})\n"
            "while e.has_unfinished_requests(): e.step()\n"
            "assert e.tracer is None, e.tracer\n"
            "assert 'opentelemetry.sdk.trace' not in sys.modules\n" % TRACEPARENT)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Received a request with trace context but tracing is disabled" in done.stderr


class _Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: keeps each POST body on the server."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.received.append((self.path, self.headers["Content-Type"], body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_spans_reach_an_otlp_http_receiver_and_a_server_continues_the_callers_traceparent():
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    server = http.server.HTTPServer(("127.0.0.1", 0), _Receiver)
    server.received = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    llm = AsyncLLM(LLMEngine(device="cpu", block_size=8, num_kv_blocks=32, otlp_traces_endpoint=endpoint))
    app = build_app(llm, model_name=MODEL)

    async def go():
        async with client(app) as c:
            body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
            reply = await c.post("/v1/completions", json=body,
                                 headers={"traceparent": TRACEPARENT, "X-Request-Id": "http-1"})
            assert reply.status_code == 200, reply.text
        await llm.call(llm.engine.tracer.force_flush)
        await llm.shutdown()

    try:
        asyncio.run(go())
    finally:
        server.shutdown()
    assert [(path, ctype) for path, ctype, _ in server.received] == [("/v1/traces", "application/x-protobuf")]
    request = ExportTraceServiceRequest.FromString(server.received[0][2])
    (span,) = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert span.name == "llm_request" and span.kind == Span.SPAN_KIND_SERVER
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_SPAN
    attributes = {kv.key: kv.value for kv in span.attributes}
    # the prompt's engine request f"{id}-{i}" (vLLM's completions name it so; V1's span
    # carries that external_req_id)
    assert attributes["gen_ai.request.id"].string_value == "cmpl-http-1-0"
    assert attributes["gen_ai.usage.completion_tokens"].int_value == 5
    assert attributes["gen_ai.request.max_tokens"].int_value == 5
    e2e = attributes["gen_ai.latency.e2e"].double_value
    assert e2e > 0 and abs((span.end_time_unix_nano - span.start_time_unix_nano) - e2e * 1e9) <= 2
