"""Every view of a request's times agrees exactly: the request events in the history (what
the timeline and the requests table are folded from), ``requests_dataframe()``, the final
``RequestOutput.metrics`` and the statistics the stat loggers (``/metrics``) receive.

Reference: the timestamps of the request events themselves, subtracted by hand; the
Prometheus sums against the observations handed to a recording logger in the same order.
"""

import pytest

from workbench import LLMEngine, SamplingParams
from workbench.metrics.prometheus import PrometheusStatLogger
from workbench.metrics.stats import StatLoggerBase


class Collect(StatLoggerBase):
    def __init__(self):
        self.ttfts, self.finished = [], []

    def record(self, scheduler_stats, iteration_stats):
        self.ttfts += iteration_stats.time_to_first_tokens_iter
        self.finished += iteration_stats.finished_requests

    def log(self):
        pass


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def event_times(history):
    """request id -> {kind: time of its first event of that kind} (first scheduled included)."""
    times: dict[str, dict[str, float]] = {}
    for record in history:
        for e in record.request_events:
            times.setdefault(e.request_id, {}).setdefault(e.kind, e.time)
    return times


def test_events_dataframe_outputs_and_metrics_agree_to_the_bit():
    engine = LLMEngine(device="cpu", dtype="float32", block_size=8, num_kv_blocks=64,
                       max_num_batched_tokens=16, max_num_seqs=3)
    collect, prom = Collect(), PrometheusStatLogger("m")
    engine.add_logger("collect", collect)
    engine.add_logger("prom", prom)
    # A stop string that the greedy text of "JULIET:" contains: that request ends by the
    # output processor's report, not by the scheduler's own stop conditions.
    engine.add_request("probe", "JULIET:", greedy(12))
    while engine.has_unfinished_requests():
        (probe,) = [o for o in engine.step() if o.finished] or [None]
    text = probe.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text

    engine.add_request("length", "ROMEO:\nBut soft, what light through yonder window", greedy(5))
    engine.add_request("stop", "JULIET:", greedy(12, stop=[stop]))
    engine.add_request("abort", "HAMLET:", greedy(40))
    engine.add_request("queued", "LEAR:", greedy(3))  # waits: max_num_seqs is 3
    final = {}
    for i in range(100):
        final.update({o.request_id: o for o in engine.step() if o.finished})
        if i == 3:
            engine.abort_request("abort")
        if not engine.has_unfinished_requests():
            break
    # An aborted request produces no output (vLLM's rule); the history and tables record it.
    assert {o.outputs[0].finish_reason for o in final.values()} == {"length", "stop"}
    assert final["stop"].outputs[0].finish_reason == "stop" and "abort" not in final

    times = event_times(engine.history)
    frame = engine.requests_dataframe().set_index("request_id")
    assert frame.loc["abort"].finish_reason == "abort" and "finished" in times["abort"]
    for rid, out in final.items():
        t = times[rid]
        arrival = t["arrived"]
        row = frame.loc[rid]
        m = out.metrics
        assert (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time) == (
            arrival, t["scheduled"], t["first_token"], t["finished"]), rid
        assert (row.queue_s, row.ttft_s, row.e2e_s) == (
            t["scheduled"] - arrival, t["first_token"] - arrival, t["finished"] - arrival), rid
        assert (m.queue_time, m.time_to_first_token, m.e2e_latency) == (
            row.queue_s, row.ttft_s, row.e2e_s), rid
    assert frame.loc["queued"].queue_s > 0

    # What every stat logger got (the probe included), request by request.
    every = [(rid, t) for rid, t in times.items()]
    assert sorted(collect.ttfts) == sorted(t["first_token"] - t["arrived"] for _, t in every)
    got = sorted((f.finish_reason, f.e2e_latency, f.queued_time, f.time_to_first_token)
                 for f in collect.finished)
    by_rid = {rid: frame.loc[rid] for rid, _ in every}
    want = sorted((by_rid[rid].finish_reason, t["finished"] - t["arrived"],
                   t["scheduled"] - t["arrived"], t["first_token"] - t["arrived"])
                  for rid, t in every)
    assert got == want

    def prom_sum(name):
        return prom.registry.get_sample_value(f"vllm:{name}_sum", {"model_name": "m"})

    assert prom_sum("time_to_first_token_seconds") == sum(collect.ttfts)
    assert prom_sum("e2e_request_latency_seconds") == sum(f.e2e_latency for f in collect.finished)
    assert prom_sum("request_queue_time_seconds") == sum(f.queued_time for f in collect.finished)


def test_the_timeline_marks_finishes_at_the_tables_steps():
    pytest.importorskip("ipywidgets")
    from workbench.viz.timeline import request_spans

    engine = LLMEngine(device="cpu", dtype="float32", block_size=8, num_kv_blocks=64,
                       max_num_batched_tokens=16)
    for i, n in enumerate((3, 6)):
        engine.add_request(f"r{i}", "ROMEO:", greedy(n))
    while engine.has_unfinished_requests():
        engine.step()
    _, spans = request_spans(engine.history)
    frame = engine.requests_dataframe().set_index("request_id")
    finishes = {s["request_id"]: (s["start"], s["reason"]) for s in spans if s["kind"] == "finish"}
    assert finishes == {rid: (row.finished_step, row.finish_reason) for rid, row in frame.iterrows()}


def test_an_aborted_request_has_no_time_for_the_phases_it_never_reached():
    """vLLM records no time for a phase a request never reached: aborted while queued, it has
    no queued_time (nor any later one); aborted mid-prefill, a queued_time but no time to first
    token, prefill, decode or inference. Reference: the request events' own timestamps."""
    engine = LLMEngine(device="cpu", dtype="float32", block_size=8, num_kv_blocks=64,
                       max_num_batched_tokens=8, max_num_seqs=1)
    collect, prom = Collect(), PrometheusStatLogger("m")
    engine.add_logger("collect", collect)
    engine.add_logger("prom", prom)
    long_prompt = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east"
    engine.add_request("prefilling", long_prompt, greedy(4))  # more than one 8-token chunk
    engine.add_request("queued", "LEAR:", greedy(3))  # waits: max_num_seqs is 1
    engine.step()
    engine.abort_request("prefilling")
    engine.abort_request("queued")
    for _ in range(3):
        engine.step()
    times = event_times(engine.history)
    assert "scheduled" not in times["queued"] and "first_token" not in times["prefilling"]
    stats = {f.num_prompt_tokens: f for f in collect.finished}
    queued = stats[len(engine.tokenizer.encode("LEAR:"))]
    prefilling = stats[len(engine.tokenizer.encode(long_prompt))]
    assert {queued.finish_reason, prefilling.finish_reason} == {"abort"}
    t = times["queued"]
    assert queued.e2e_latency == t["finished"] - t["arrived"]
    assert (queued.queued_time, queued.time_to_first_token, queued.prefill_time,
            queued.decode_time, queued.inference_time, queued.mean_time_per_output_token) == (
        None, None, None, None, None, None)
    t = times["prefilling"]
    assert prefilling.e2e_latency == t["finished"] - t["arrived"]
    assert prefilling.queued_time == t["scheduled"] - t["arrived"]
    assert (prefilling.time_to_first_token, prefilling.prefill_time, prefilling.decode_time,
            prefilling.inference_time, prefilling.mean_time_per_output_token) == (
        None, None, None, None, None)

    def prom_count(name):
        return prom.registry.get_sample_value(f"vllm:{name}_count", {"model_name": "m"})

    # both ended (e2e), one was ever scheduled (queue time), none reached a token
    assert prom_count("e2e_request_latency_seconds") == 2
    assert prom_count("request_queue_time_seconds") == 1
    assert prom_count("request_prefill_time_seconds") == 0
    assert prom_count("request_decode_time_seconds") == 0
