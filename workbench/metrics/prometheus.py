"""PrometheusStatLogger: the engine's statistics as vLLM's ``vllm:`` Prometheus series.

Names, types and labels follow vLLM, so dashboards and alerts written for vLLM resolve
(vLLM has no grammar series: those are ``workbench:grammar_*``):
every series carries ``model_name``; counters are exposed with the ``_total`` suffix;
``vllm:request_success`` adds ``finished_reason``. Each logger owns its own
``CollectorRegistry`` (``.registry``), so several engines in one process never clash;
serve it with ``prometheus_client.generate_latest(logger.registry)``.
No web framework is imported here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from workbench.utils.reprs import html_table
from workbench.metrics.stats import IterationStats, SchedulerStats, StatLoggerBase

FINISH_REASONS = ("stop", "length", "abort", "error")


def one_two_five(low: float, high: float) -> list[float]:
    """Bucket bounds 1, 2, 5 times powers of ten from ``low`` up to ``high`` (inclusive)."""
    bounds: list[float] = []
    decade = low
    while decade <= high:
        for m in (1, 2, 5):
            value = round(decade * m, 6)
            if value <= high:
                bounds.append(value)
        decade *= 10
    return bounds


class PrometheusStatLogger(StatLoggerBase):
    """Records every step into vLLM-named gauges, counters and histograms (see module doc).

    ``log()`` does nothing: Prometheus pulls. Gauges show the latest step's state.
    """

    def __init__(self, model_name: str, *, max_model_len: int = 100_000,
                 max_lora: int | None = None) -> None:
        """``max_lora``: the engine's ``max_loras`` when LoRA is enabled (adds vLLM's
        ``vllm:lora_requests_info``)."""
        self.model_name = model_name
        self.max_lora = max_lora
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        seconds = one_two_five(0.001, 1000.0)
        tokens = one_two_five(1, max_model_len)
        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason", "Number of requests waiting, by reason: "
            "capacity (blocked on budget, seats or KV) or deferred (grammar, remote KV).",
            labels + ["reason"], registry=reg)
        self.num_requests_waiting_by_reason = {r: by_reason.labels(model_name, r)
                                               for r in ("capacity", "deferred")}
        deferred = Histogram(
            "vllm:request_deferred_time_seconds", "Histogram of time a request was deferred "
            "(its grammar compiling, or its KV on a remote instance) in seconds.",
            labels + ["reason"], buckets=seconds, registry=reg)
        self.request_deferred_time = {r: deferred.labels(model_name, r) for r in ("grammar", "remote_kv")}
        preempted = Counter(
            "workbench:num_preemptions_by_reason", "Cumulative preemptions by reason: made_room "
            "(for another request) or own_victim (the request short of KV blocks was chosen).",
            labels + ["reason"], registry=reg)
        self.num_preemptions_by_reason = {r: preempted.labels(model_name, r) for r in ("made_room", "own_victim")}
        self.kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            labels + ["finished_reason"], registry=reg,
        )
        self.request_success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            seconds)
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            seconds)
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (the inter-token latencies).", seconds)
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", seconds)
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            seconds)
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.", seconds)
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", seconds)
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", seconds)
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", seconds)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.grammar_compiles = counter(
            "workbench:grammar_compiles", "Structured-output grammars compiled (one per "
            "distinct constraint; cache hits excluded).")
        self.grammar_compile_seconds = histogram(
            "workbench:grammar_compile_seconds", "Histogram of grammar compile time in seconds.",
            one_two_five(0.0001, 100.0))
        self.grammar_cache_hits = counter(
            "workbench:grammar_cache_hits", "Constrained requests whose grammar was already "
            "compiled or compiling.")
        self.spec_decode_num_drafts = counter(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.", labels + ["position"], registry=reg)
        self._accepted_per_pos = lambda pos: per_pos.labels(model_name, str(pos))
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            [2.0**i for i in range(15)])
        #: vLLM's info gauge: its labels name the running and waiting adapters (comma-
        #: separated) and max_lora, its value is the time it was set. One series: the latest.
        self.lora_requests_info = None if max_lora is None else Gauge(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=reg)
        self._kv_histograms = None  # vLLM's NIXL histograms, from the first KV load on

    #: vLLM's NIXL connector histograms (name, help, buckets), registered at the first KV load.
    KV_TRANSFER_HISTOGRAMS = (
        ("transfer_duration", "vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for KV "
         "Cache transfers.", one_two_five(0.0001, 10.0)),
        ("bytes_transferred", "vllm:nixl_bytes_transferred", "Histogram of bytes transferred per KV "
         "Cache transfers.", [2.0**i for i in range(10, 36, 2)]),
        ("num_descriptors", "vllm:nixl_num_descriptors", "Histogram of number of descriptors per KV "
         "Cache transfers.", [2.0**i for i in range(15)]),
    )

    def _record_kv_transfers(self, stats) -> None:
        if self._kv_histograms is None:
            self._kv_histograms = {
                field: Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(
                    self.model_name) for field, name, doc, buckets in self.KV_TRANSFER_HISTOGRAMS}
        for field, histogram in self._kv_histograms.items():
            for value in getattr(stats, field):
                histogram.observe(value)

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        s, it = scheduler_stats, iteration_stats
        self.num_requests_running.set(s.num_running_reqs)
        self.num_requests_waiting.set(s.num_waiting_reqs)
        by_reason = s.num_waiting_reqs_by_reason or {"capacity": s.num_waiting_reqs}
        for reason, series in self.num_requests_waiting_by_reason.items():
            series.set(by_reason.get(reason, 0))
        for reason, n in s.num_preemptions_by_reason.items():
            self.num_preemptions_by_reason[reason].inc(n)
        for reason, seconds in it.deferred_times:
            self.request_deferred_time[reason].observe(seconds)
        self.kv_cache_usage_perc.set(s.kv_cache_usage)
        self.prefix_cache_queries.inc(s.prefix_cache_queries)
        self.prefix_cache_hits.inc(s.prefix_cache_hits)
        self.num_preemptions.inc(s.num_preemptions)
        if self.lora_requests_info is not None:
            self.lora_requests_info.clear()
            self.lora_requests_info.labels(
                str(self.max_lora), ",".join(s.waiting_lora_adapters),
                ",".join(s.running_lora_adapters)).set_to_current_time()
        if s.kv_connector_stats is not None:
            self._record_kv_transfers(s.kv_connector_stats)
        if s.spec_decoding_stats is not None:
            spec = s.spec_decoding_stats
            self.spec_decode_num_drafts.inc(spec.num_drafts)
            self.spec_decode_num_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_decode_num_accepted_tokens.inc(spec.num_accepted_tokens)
            for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                self._accepted_per_pos(pos).inc(n)
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        if it.num_prompt_tokens or it.num_generation_tokens:
            self.iteration_tokens.observe(it.num_prompt_tokens + it.num_generation_tokens)
        for ttft in it.time_to_first_tokens_iter:
            self.time_to_first_token.observe(ttft)
        for itl in it.inter_token_latencies_iter:
            self.inter_token_latency.observe(itl)
            self.time_per_output_token.observe(itl)
        self.grammar_compiles.inc(len(it.grammar_compile_seconds))
        for seconds in it.grammar_compile_seconds:
            self.grammar_compile_seconds.observe(seconds)
        self.grammar_cache_hits.inc(it.num_grammar_cache_hits)
        for f in it.finished_requests:
            self.request_success[f.finish_reason].inc()
            self.e2e_request_latency.observe(f.e2e_latency)
            self.request_prompt_tokens.observe(f.num_prompt_tokens)
            self.request_generation_tokens.observe(f.num_generation_tokens)
            for series, seconds in ((self.request_queue_time, f.queued_time),
                                    (self.request_inference_time, f.inference_time),
                                    (self.request_prefill_time, f.prefill_time),
                                    (self.request_decode_time, f.decode_time),
                                    (self.request_time_per_output_token,
                                     f.mean_time_per_output_token)):
                if seconds is not None:  # a phase the request never reached: no observation
                    series.observe(seconds)

    def __repr__(self) -> str:
        return f"PrometheusStatLogger(model_name={self.model_name!r})"

    def _repr_html_(self) -> str:
        series = sorted({m.name for m in self.registry.collect()})
        return html_table("PrometheusStatLogger", {
            "model_name": self.model_name, "series": ", ".join(series)})
