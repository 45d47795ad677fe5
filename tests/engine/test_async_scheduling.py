"""Async scheduling (``async_scheduling=True``, vLLM's AsyncScheduler and batch queue of two).

The reference is the synchronous engine, run on the same requests: with batch-invariant
kernels a request's greedy tokens do not depend on its batch, so async scheduling -- whose
batches differ (a step is decided one token early, a stop is found one step late) -- must give
each request exactly the same tokens, under chunked prefill, preemption and aborts (drawn by
hypothesis), and for every feature it supports; and transformers' greedy tokens directly.
"""

from __future__ import annotations

import argparse
import time

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench import EngineArgs, LLMEngine, SamplingParams, default_model_path
from workbench.benchmarks.checks import generate, hf_greedy
from workbench.config import teaching_config
from workbench.core.sched.async_scheduler import PLACEHOLDER_TOKEN_ID
from workbench.sampling_params import StructuredOutputsParams
from workbench.worker.model_runner import ModelRunner

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?", "HAMLET:\nTo be, or not",
           "LEAR:", "KING HENRY:\nOnce more unto the breach, dear friends", "PUCK:\nIf we shadows"]


def engine(async_scheduling: bool, **kw) -> LLMEngine:
    return LLMEngine(teaching_config(async_scheduling=async_scheduling, batch_invariant=True, **kw))


def run(eng: LLMEngine, plan: dict[int, list], aborts: dict[int, list[str]] | None = None) -> dict:
    """Step ``eng`` to the end; before step() call k, add ``plan[k]`` (id, prompt, params)
    and abort ``aborts[k]``. Returns each request's last output; checks the invariants."""
    last, k = {}, 0
    while k <= max(plan, default=0) or eng.has_unfinished_requests():
        for rid, prompt, params in plan.get(k, ()):
            eng.add_request(rid, prompt, params)
        eng.abort_request((aborts or {}).get(k, []))
        for out in eng.step():
            last[out.request_id] = out
        eng.scheduler.check_invariants()
        k += 1
    assert eng.kv_cache.num_free_blocks == eng.kv_cache.num_blocks, "blocks leaked"
    return last


def tokens(outputs: dict) -> dict:
    return {rid: [(c.token_ids, c.finish_reason) for c in o.outputs] for rid, o in outputs.items()}


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(PROMPTS), st.integers(1, 12), st.integers(0, 4),
                          st.booleans()), min_size=1, max_size=6),
       st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), max_size=2))
def test_greedy_tokens_equal_the_synchronous_engines(requests, aborts):
    """Drawn arrivals, lengths, stop tokens and aborts on the teaching engine (24 blocks of 4,
    32 tokens a step: chunked prefill and preemption): the requests not aborted get the same
    tokens and finish reasons; an aborted one's tokens are a prefix of the other run's."""
    plan, abort_at = {}, {}
    for i, (prompt, max_tokens, at, stop) in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=max_tokens,
                                stop_token_ids=[201] if stop else None)  # "\n": often sampled
        plan.setdefault(at, []).append((f"r{i}", prompt, params))
    for i, at in aborts:
        if i < len(requests):
            abort_at.setdefault(at, []).append(f"r{i}")
    sync, async_ = (tokens(run(engine(a), plan, abort_at)) for a in (False, True))
    aborted = {rid for ids in abort_at.values() for rid in ids}
    for rid in set(sync) | set(async_):
        if rid not in aborted:
            assert async_[rid] == sync[rid], rid
        elif rid in sync and rid in async_:
            a, b = sync[rid][0][0], async_[rid][0][0]
            assert a[:len(b)] == b or b[:len(a)] == a, rid


def test_a_stop_found_one_step_late():
    """A stop token, and a stop string, found by the sampled token: the step scheduled
    meanwhile computed a token for the finished request, which is dropped (the record says so);
    the outputs equal the synchronous engine's."""
    plan = {0: [("tok", "ROMEO:", SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[201])),
                ("str", "HAMLET:\nTo be, or not", SamplingParams(temperature=0, max_tokens=30, stop=["\n"])),
                ("long", "LEAR:", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))]}
    sync, eng = engine(False), engine(True)
    assert tokens(run(eng, plan)) == tokens(run(sync, plan))
    discarded = {rid for r in eng.history for rid in r.overlap.discarded}
    assert {"tok", "str"} <= discarded
    placeholders = [r for r in eng.history if r.overlap.placeholders]
    assert placeholders and all(
        c.token_ids[-1] == PLACEHOLDER_TOKEN_ID
        for r in placeholders for c in r.scheduler_output.scheduled if c.request_id in r.overlap.placeholders)
    # max_tokens is known ahead: no step is scheduled past it ("long" never has a token dropped)
    assert "long" not in discarded


def test_a_request_preempted_with_its_last_token_in_flight_finishes_in_the_waiting_queue():
    """A 9-block pool: "last" (max_tokens 2) is preempted while the step computing its last
    token is in flight; that token still reaches it and ends it in the waiting queue (it is
    never resumed): every request gets the synchronous engine's tokens."""
    def greedy(n):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    plan = {0: [("a", PROMPTS[3], greedy(5))], 1: [("b", PROMPTS[4], greedy(13))],
            2: [("c", PROMPTS[5], greedy(12))],
            3: [("last", PROMPTS[0], greedy(2)), ("d", PROMPTS[1], greedy(10))]}
    eng = engine(True, num_kv_blocks=9, max_num_seqs=3)
    assert tokens(run(eng, plan)) == tokens(run(engine(False, num_kv_blocks=9, max_num_seqs=3), plan))
    kinds = [type(e).__name__ for e in eng.history.request_log("last")]
    assert "RequestPreempted" in kinds and "RequestResumed" not in kinds
    assert kinds[-1] == "RequestFinished" and eng.history.request_log("last")[-1].reason == "length"


FEATURES = {
    "penalties": SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, frequency_penalty=0.5),
    "min_tokens": SamplingParams(temperature=0, max_tokens=10, min_tokens=6, stop_token_ids=[201]),
    "seeded-logprobs": SamplingParams(temperature=0.8, seed=7, max_tokens=10, logprobs=2),
    "n=2": SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=8),
    "prompt_logprobs": SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1),
    "json": SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})),
}


def test_each_supported_feature_gives_the_synchronous_outputs():
    """One batch of every feature (penalties, min_tokens, seeds, logprobs, n > 1, prompt
    logprobs, structured outputs): the same tokens, logprobs and prompt logprobs. Those that
    read their last token on the host (penalties, min_tokens, the grammar) defer their step."""
    plan = {0: [(name, PROMPTS[i % 3], params) for i, (name, params) in enumerate(FEATURES.items())]}
    eng = engine(True)
    sync, async_ = run(engine(False), plan), run(eng, plan)
    assert tokens(async_) == tokens(sync)
    for rid in sync:
        for a, b in zip(async_[rid].outputs, sync[rid].outputs):
            assert (a.logprobs is None) == (b.logprobs is None)
            if a.logprobs:
                assert [{t: round(v.logprob, 4) for t, v in d.items()} for d in a.logprobs] == \
                       [{t: round(v.logprob, 4) for t, v in d.items()} for d in b.logprobs]
    assert async_["prompt_logprobs"].prompt_logprobs == sync["prompt_logprobs"].prompt_logprobs
    deferred = {rid for r in eng.history for rid in r.overlap.deferred}
    assert {"penalties", "min_tokens", "json"} <= deferred
    assert not deferred & {"seeded-logprobs", "prompt_logprobs"}


def test_greedy_tokens_equal_transformers():
    """The default (not batch-invariant) kernels, a pool tight enough to preempt and chunk."""
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompts = [tok(p).input_ids for p in PROMPTS]
    eng = LLMEngine(model=str(path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=16,
                    max_num_seqs=6, max_num_batched_tokens=24, async_scheduling=True)
    outs = generate(eng, prompts, SamplingParams(temperature=0, max_tokens=16))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, ids, 16, stop_at_eos=True)[0]
    rows = eng.history.to_dataframe()
    assert rows["preempted"].sum() > 0
    assert any(s.is_prefill and not s.samples for r in eng.history for s in r.scheduler_output.scheduled)


class SlowRunner(ModelRunner):
    """A runner whose batch takes 30 ms longer (sleeping, as a GPU's forward leaves the host free)."""

    def execute(self, *args, **kwargs):
        time.sleep(0.03)
        return super().execute(*args, **kwargs)


def test_step_n_plus_1_is_scheduled_under_the_forward_of_step_n():
    eng = LLMEngine(teaching_config(async_scheduling=True), make_runner=SlowRunner)
    run(eng, {0: [("a", "ROMEO:", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]})
    records = list(eng.history)
    steady = records[1:-1]
    assert steady and all(r.overlap.scheduled_under == r.step - 1 for r in steady)
    for prev, rec in zip(records, records[1:]):
        if rec.overlap.scheduled_under == prev.step:
            start, end = rec.overlap.spans["schedule"]
            f_start, f_end = prev.overlap.spans["forward"]
            assert f_start <= start and end <= f_end, (rec.step, rec.overlap.spans, prev.overlap.spans)


def test_the_synchronous_engine_records_no_overlap():
    eng = engine(False)
    run(eng, {0: [("a", "ROMEO:", SamplingParams(temperature=0, max_tokens=3))]})
    assert all(r.overlap is None for r in eng.history)


def test_vllms_refusal_and_the_flag():
    with pytest.raises(ValueError, match="Currently, async scheduling is only supported with "
                                         "EAGLE/MTP/Draft Model/NGram GPU kind of speculative decoding"):
        EngineArgs(async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--async-scheduling"])).async_scheduling
    assert not EngineArgs.from_cli_args(parser.parse_args([])).async_scheduling


def test_pooling_and_a_kv_connector_are_refused_by_name():
    """The AsyncScheduler has neither the pooling nor the KV-connector path: refused up front
    (the config), and a pooling request given to an async engine is refused with nothing queued."""
    from workbench.pooling_params import PoolingParams

    with pytest.raises(ValueError, match="async_scheduling: not supported with runner 'pooling'"):
        EngineArgs(async_scheduling=True, runner="pooling")
    with pytest.raises(ValueError, match="async_scheduling: not supported with kv_transfer_config"):
        EngineArgs(async_scheduling=True, kv_transfer_config={"kv_role": "kv_producer"})
    eng = engine(True)
    with pytest.raises(ValueError, match="pooling requests are not supported with async scheduling"):
        eng.add_request("p", "ROMEO:", PoolingParams())
    assert not eng.has_unfinished_requests()


def test_a_fork_with_a_step_in_flight_steps_as_the_original():
    plan = {0: [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=10)) for i, p in enumerate(PROMPTS[:3])]}
    eng = engine(True)
    for rid, prompt, params in plan[0]:
        eng.add_request(rid, prompt, params)
    eng.step()
    eng.step()
    fork = eng.fork()
    assert tokens(run(fork, {})) == tokens(run(eng, {}))


def test_the_views_show_the_overlap_and_the_one_step_late_effects():
    """The player's notes name the placeholder and the dropped token; the Perfetto export draws
    each step's schedule on the engine track inside the previous step's forward on the
    worker's; the overlap figure draws a bar per span."""
    from workbench.metrics.perfetto import WORKER_TID, trace_events
    from workbench.viz.overlap import overlap_figure
    from workbench.viz.player import StepPlayer

    eng = LLMEngine(teaching_config(async_scheduling=True), make_runner=SlowRunner)
    run(eng, {0: [("s", "ROMEO:", SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[201])),
                  ("l", "LEAR:", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]})
    late = next(r for r in eng.history if r.overlap.discarded == ("s",))
    player = StepPlayer(eng.history, controls=False, live_updates=False)
    player.show(late.step)
    notes = " ".join(player.notes)
    assert f"Step {late.step} was scheduled while step {late.step - 1} was in flight" in notes
    assert "s had already finished (a stop found one step late)" in notes
    assert "the input token was a placeholder" in notes
    events = trace_events(eng.history)
    forward = {e["name"]: e for e in events if e.get("tid") == WORKER_TID and e["ph"] == "X"}
    schedule = {e["name"]: e for e in events if e.get("tid") == 0 and e["name"].startswith("schedule ")}
    for step in range(1, len(eng.history) - 1):
        f, s = forward[f"step {step - 1}"], schedule[f"schedule {step}"]
        assert f["ts"] <= s["ts"] and s["ts"] + s["dur"] <= f["ts"] + f["dur"], step
    ax = overlap_figure(list(eng.history)).axes[0]
    assert len(ax.collections) == sum(len(r.overlap.spans) for r in eng.history)
