"""/metrics' why: vllm:num_requests_waiting_by_reason sums to vllm:num_requests_waiting at every
scrape, its "deferred" series counts the waiting requests whose grammar compiles (counted here
from the queue), deferred times are observed for the requests the records saw deferred, and
preemptions by reason add up to vllm:num_preemptions."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from workbench.config import EngineArgs
from workbench.core.sched.explain import Reason
from workbench.engine.llm_engine import LLMEngine
from workbench.metrics.prometheus import PrometheusStatLogger
from workbench.request import RequestStatus
from workbench.sampling_params import SamplingParams, StructuredOutputsParams


def scrape(prom) -> dict:
    samples = {}
    for family in text_string_to_metric_families(generate_latest(prom.registry).decode()):
        for s in family.samples:
            samples[(s.name, s.labels.get("reason"))] = s.value
    return samples


def test_waiting_reasons_sum_to_the_waiting_count_at_every_scrape():
    engine = LLMEngine(EngineArgs(device="cpu", block_size=8, num_kv_blocks=9, max_num_seqs=3,
                                  max_num_batched_tokens=32))
    prom = PrometheusStatLogger("tiny")
    engine.add_logger("prom", prom)
    prompt = {"prompt_token_ids": list(range(5, 29))}
    for i in range(6):
        so = StructuredOutputsParams(choice=["to be", "not to be"]) if i % 2 else None
        engine.add_request(f"r{i}", prompt if i < 4 else {"prompt_token_ids": [7] * (20 + i)},
                           SamplingParams(max_tokens=40, ignore_eos=so is None, structured_outputs=so))
    seen_waiting = 0
    while engine.has_unfinished_requests():
        engine.step()
        got = scrape(prom)
        waiting = got[("vllm:num_requests_waiting", None)]
        capacity = got[("vllm:num_requests_waiting_by_reason", "capacity")]
        deferred = got[("vllm:num_requests_waiting_by_reason", "deferred")]
        assert capacity + deferred == waiting == len(engine.scheduler.waiting)
        assert deferred == sum(r.status is RequestStatus.WAITING_FOR_FSM for r in engine.scheduler.waiting)
        seen_waiting += waiting > 0
    assert seen_waiting  # the queue was not always empty
    got = scrape(prom)
    history = list(engine.history)
    deferred_ids = {rid for r in history for rid, w in r.reasons.items() if w.reason is Reason.GRAMMAR_COMPILING}
    assert got[("vllm:request_deferred_time_seconds_count", "grammar")] == len(deferred_ids)
    assert got[("vllm:request_deferred_time_seconds_count", "remote_kv")] == 0
    preemptions = [p for r in history for p in r.preemptions]
    assert preemptions  # 9 blocks cannot hold three 40-token continuations
    own = sum(p.made_room_for == p.request_id for p in preemptions)
    assert got[("workbench:num_preemptions_by_reason_total", "own_victim")] == own
    assert got[("workbench:num_preemptions_by_reason_total", "made_room")] == len(preemptions) - own
    assert got[("vllm:num_preemptions_total", None)] == len(preemptions)
