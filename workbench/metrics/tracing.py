"""OpenTelemetry request tracing as vLLM's: one ``llm_request`` span (kind SERVER) per finished
request, continuing the caller's W3C trace context, with vLLM's attribute names.

A span starts at the request's arrival and ends when it finished; its latency attributes are
the request's own times (the same events :class:`~workbench.metrics.request_tracker.RequestTracker`
folds): queue = first scheduled - arrival, time to first token = first token - arrival,
prefill = first token - first scheduled, decode = last token - first token, inference = last
token - first scheduled, e2e = finished - arrival (the last token is the finishing step's).
Requests aborted by the caller get no span (vLLM traces the requests its output processor
finishes); with n > 1 each child gets its own span (vLLM V1's rule: one per request state). ``collect_detailed_traces`` ("model", "worker", "all") adds one span event per
scheduling decision (``scheduled``, ``preempted``, ``resumed``) and, for "model"/"all", the
model forward time, for "worker"/"all" the model execute time, summed over the request's steps.

OpenTelemetry is imported only by an engine that traces: one with ``otlp_traces_endpoint``.
The exporter speaks OTLP over HTTP/protobuf unless ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
says ``grpc`` (which needs ``opentelemetry-exporter-otlp-proto-grpc``; vLLM's default).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from workbench.core.request_events import (
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPreempted,
    RequestResumed,
    RequestScheduled,
)

logger = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"


class SpanAttributes:
    """vLLM's span attribute names (the gen_ai semantic conventions and its own additions)."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
    GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def is_otel_available() -> bool:
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


def get_span_exporter(endpoint: str):
    """The OTLP span exporter to ``endpoint`` (see the module docstring for the protocol)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"Unsupported OTLP protocol '{protocol}' is configured")
    return OTLPSpanExporter(endpoint=endpoint)


def extract_trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace-context headers among ``headers`` (any case, as HTTP headers come)."""
    lower = {k.lower(): v for k, v in headers.items()}
    return {h: lower[h] for h in TRACE_HEADERS if h in lower}


def check_trace_headers(trace_headers: object) -> dict[str, str] | None:
    """``trace_headers`` as a dict of str -> str (None or empty: None); ValueError otherwise."""
    if not trace_headers:
        return None
    if not isinstance(trace_headers, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in trace_headers.items()):
        raise ValueError(f"trace_headers must be a mapping of header names to strings, got {trace_headers!r}.")
    return dict(trace_headers)


_warned = False


def log_tracing_disabled_warning() -> None:
    """vLLM's warning, once per process."""
    global _warned
    if not _warned:
        _warned = True
        logger.warning("Received a request with trace context but tracing is disabled")


@dataclass
class _Traced:
    """What a span needs of one scheduler request, gathered from its events."""

    parent_id: str
    params: object  # SamplingParams
    trace_headers: dict[str, str] | None
    arrived: RequestArrived | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    forward_s: float = 0.0
    execute_s: float = 0.0
    decisions: list = field(default_factory=list)  # (name, time, attributes)


class RequestTracer:
    """Turns the engine's request events into ``llm_request`` spans on an OpenTelemetry
    ``tracer``; ``clock`` is the engine's (its seconds are mapped to the epoch nanoseconds
    OpenTelemetry wants by one offset read at construction). ``provider`` (optional) is
    flushed by :meth:`force_flush` and :meth:`shutdown`."""

    def __init__(self, tracer, model_name: str, clock: Callable[[], float], *,
                 collect_detailed_traces: str | None = None, provider=None) -> None:
        self.tracer, self.provider, self.model_name = tracer, provider, model_name
        self.detailed = collect_detailed_traces
        self._offset_ns = time.time_ns() - round(clock() * 1e9)
        self._requests: dict[str, _Traced] = {}  # scheduler request id -> what is known

    @classmethod
    def from_endpoint(cls, otlp_traces_endpoint: str, model_name: str, clock: Callable[[], float], *,
                      collect_detailed_traces: str | None = None) -> RequestTracer:
        """vLLM's ``init_tracer``: a TracerProvider batching spans to the OTLP exporter
        (ValueError, with vLLM's words, when OpenTelemetry is not installed)."""
        if not is_otel_available():
            raise ValueError("OpenTelemetry is not available. Unable to configure 'otlp_traces_endpoint'. "
                             "Ensure OpenTelemetry packages are installed (pip install opentelemetry-sdk "
                             "opentelemetry-exporter-otlp-proto-http).")
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(get_span_exporter(otlp_traces_endpoint)))
        return cls(provider.get_tracer("workbench.engine.llm_engine"), model_name, clock,
                   collect_detailed_traces=collect_detailed_traces, provider=provider)

    def add_request(self, parent_id: str, children: Iterable, trace_headers) -> None:
        """Follow the scheduler requests ``children`` (Requests) of request ``parent_id``.

        vLLM V1 traces each request state its output processor finishes: with n > 1 that is
        one span per child (``{i}_{id}``), each naming the parent's id and carrying the child's
        own parameters (n=1), not one span per request as the V0 seed did."""
        for child in children:
            self._requests[child.request_id] = _Traced(parent_id, child.sampling_params, trace_headers)

    def consume(self, record) -> None:
        """Fold one StepRecord's request events; end the spans of requests that finished."""
        timings = record.timings
        for e in record.request_events:
            traced = self._requests.get(e.request_id)
            if traced is None:
                continue
            if isinstance(e, RequestArrived):
                traced.arrived = e
            elif isinstance(e, RequestScheduled):
                if traced.first_scheduled is None:
                    traced.first_scheduled = e.time
                if self.detailed:
                    traced.forward_s += timings.get("forward", 0.0)
                    traced.execute_s += sum(timings.get(k, 0.0) for k in ("prepare", "forward", "sample"))
                    traced.decisions.append(("scheduled", e.time, {
                        "scheduler.step": e.step, "schedule.kind": "prefill" if e.is_prefill else "decode",
                        "num_computed_tokens": e.start, "num_new_tokens": e.num_tokens}))
            elif isinstance(e, RequestPreempted):
                if self.detailed:
                    traced.decisions.append(("preempted", e.time, {
                        "scheduler.step": e.step, "num_computed_tokens": e.num_computed_tokens}))
            elif isinstance(e, RequestResumed):
                if self.detailed:
                    traced.decisions.append(("resumed", e.time, {
                        "scheduler.step": e.step, "num_cached_tokens": e.num_cached_tokens}))
            elif isinstance(e, RequestFirstToken):
                traced.first_token = e.time
            elif isinstance(e, RequestFinished):
                del self._requests[e.request_id]
                if e.reason != "abort" and traced.arrived is not None:
                    self._span(traced, e)

    def _ns(self, seconds: float) -> int:
        return self._offset_ns + round(seconds * 1e9)

    def _span(self, traced: _Traced, finished: RequestFinished) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        a, params, A = traced.arrived, traced.params, SpanAttributes
        scheduled = traced.first_scheduled if traced.first_scheduled is not None else finished.time
        first_token = traced.first_token if traced.first_token is not None else finished.time
        attributes = {
            A.GEN_AI_RESPONSE_MODEL: self.model_name,
            A.GEN_AI_REQUEST_ID: traced.parent_id,
            A.GEN_AI_USAGE_PROMPT_TOKENS: a.num_prompt_tokens,
            A.GEN_AI_USAGE_COMPLETION_TOKENS: finished.num_output_tokens,
            A.GEN_AI_LATENCY_TIME_IN_QUEUE: scheduled - a.time,
            A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: first_token - a.time,
            A.GEN_AI_LATENCY_E2E: finished.time - a.time,
            A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: first_token - scheduled,
            A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: finished.time - first_token,
            A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: finished.time - scheduled,
        }
        # vLLM V1's rule (OutputProcessor.do_tracing, "optional request parameters"): top_p,
        # max_tokens, temperature and n are set only when truthy, so temperature 0 (greedy) is
        # left out; V1 sets neither gen_ai.usage.num_sequences nor time_in_scheduler (the V0
        # seed's create_trace_span set all of them). Not the seed's: V1 is what vLLM runs.
        for name, value in ((A.GEN_AI_REQUEST_TOP_P, params.top_p), (A.GEN_AI_REQUEST_MAX_TOKENS, params.max_tokens),
                            (A.GEN_AI_REQUEST_TEMPERATURE, params.temperature), (A.GEN_AI_REQUEST_N, params.n)):
            if value:
                attributes[name] = value
        if self.detailed in ("model", "all"):
            attributes[A.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD] = traced.forward_s
        if self.detailed in ("worker", "all"):
            attributes[A.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE] = traced.execute_s
        context = TraceContextTextMapPropagator().extract(traced.trace_headers or {})
        span = self.tracer.start_span(SPAN_NAME, context=context, kind=SpanKind.SERVER,
                                      start_time=self._ns(a.time), attributes=attributes)
        for name, at, event_attributes in traced.decisions:
            span.add_event(name, event_attributes, timestamp=self._ns(at))
        span.end(end_time=self._ns(finished.time))

    def force_flush(self) -> None:
        if self.provider is not None:
            self.provider.force_flush()

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()

    def __repr__(self) -> str:
        return f"RequestTracer(model={self.model_name!r}, detailed={self.detailed!r}, {len(self._requests)} in flight)"
