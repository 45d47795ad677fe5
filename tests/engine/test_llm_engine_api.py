"""LLMEngine's vLLM API (seed 001): output kinds, add_request's signature, EngineArgs, stat
loggers and the Prometheus names, the context limit, and per-request fault isolation.

References: the same prompts generated alone by ``LLM.generate`` (FINAL_ONLY), counts taken
from the returned outputs and the step history, and hand-worked limits.
"""

import argparse
import dataclasses

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from workbench import LLM, EngineConfig, LLMEngine, SamplingParams
from workbench.config import EngineArgs
from workbench.core.request_events import RequestFinished
from workbench.metrics.prometheus import PrometheusStatLogger
from workbench.sampling_params import RequestOutputKind
from workbench.metrics.stats import IterationStats, SchedulerStats, StatLoggerBase

KINDS = RequestOutputKind
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo!", "HAMLET:\nTo be, or not to be", "LEAR:"]


def greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", block_size=8, num_kv_blocks=64,
               max_num_batched_tokens=32, log_stats=True)  # LLM() turns them off (vLLM's)


def drain(engine, check=True):
    """Step to the end; every output in order; invariants after each step, no leaked block."""
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
        if check:
            engine.scheduler.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks, "blocks leaked"
    return outs


def final_alone(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


# ------------------------------------------------------------------------- output kinds
def test_each_output_kind_reports_what_vllm_says(llm):
    engine = llm.engine
    (final,) = final_alone(llm, [PROMPTS[2]], greedy(10, ignore_eos=True))
    for kind in KINDS:
        engine.add_request(kind.name, PROMPTS[2],
                           greedy(10, ignore_eos=True, output_kind=kind))
    by_kind = {k.name: [] for k in KINDS}
    for out in drain(engine):
        by_kind[out.request_id].append(out)
    cumulative, delta, final_only = (by_kind[k.name] for k in KINDS)
    # CUMULATIVE: one output per generated token, each the whole sequence so far.
    assert [o.outputs[0].token_ids for o in cumulative] == [
        final.token_ids[: i + 1] for i in range(len(final.token_ids))]
    assert all(final.text.startswith(o.outputs[0].text) for o in cumulative)
    assert cumulative[-1].outputs[0].text == final.text
    # DELTA: the pieces add up to the final text and tokens.
    assert len(delta) == len(final.token_ids)
    assert "".join(o.outputs[0].text for o in delta) == final.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == final.token_ids
    # FINAL_ONLY: exactly one output, when finished.
    assert len(final_only) == 1 and final_only[0].outputs[0].token_ids == final.token_ids
    for outs in (cumulative, delta, final_only):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].outputs[0].finish_reason == "length"


def test_n2_cumulative_output_holds_every_sequence(llm):
    engine = llm.engine
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
    (expected,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    engine.add_request("p", PROMPTS[0], params)  # CUMULATIVE
    outs = drain(engine)
    assert all(o.request_id == "p" for o in outs) and outs[-1].finished
    assert [c.token_ids for c in outs[-1].outputs] == [c.token_ids for c in expected.outputs]
    assert all(len(o.outputs) == 2 for o in outs)


# ------------------------------------------------------------------------- add_request
def test_add_request_takes_vllms_positional_order(llm):
    engine = llm.engine
    engine.add_request("t", PROMPTS[0], greedy(2), 123.5)  # 4th positional: arrival_time
    assert engine.scheduler.requests["t"].arrival_time == 123.5
    assert engine.scheduler.requests["t"].priority == 0
    for bad, match in [
        (dict(lora_request=object()), "lora_request"),
        (dict(priority=1), r"^Got priority 1 but Priority scheduling is not enabled\.$"),  # vLLM's
        (dict(tokenization_kwargs={"truncation": True}), r"unsupported keys \['truncation'\]"),
        (dict(trace_headers={"traceparent": 1}), "trace_headers must be a mapping of header names to strings"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.add_request("bad", PROMPTS[1], greedy(2), **bad)
    assert set(engine.scheduler.requests) == {"t"} and engine.get_num_unfinished_requests() == 1
    drain(engine)


def test_a_processed_request_is_queued_as_it_is(llm):
    """vLLM's add_request also takes an EngineCoreRequest: the same tokens as the raw prompt
    (reference: LLM.generate alone), its id must be the one given, and it is queued once."""
    engine = llm.engine
    (expected,) = final_alone(llm, [PROMPTS[1]], greedy(6))
    request = engine.input_processor.process_inputs("pre", PROMPTS[1], greedy(6))
    assert request.prompt_token_ids == engine.get_tokenizer()(PROMPTS[1]).input_ids
    with pytest.raises(ValueError, match="differs from the EngineCoreRequest's 'pre'"):
        engine.add_request("other", request)
    engine.add_request("pre", request)
    with pytest.raises(ValueError, match="'pre' is already in flight"):
        engine.add_request("pre", request)
    (out,) = [o for o in drain(engine) if o.finished]
    assert out.prompt == PROMPTS[1] and out.outputs[0].token_ids == expected.token_ids


def test_tokenization_kwargs_reach_the_tokenizer(llm):
    engine = llm.engine
    tok = engine.get_tokenizer()
    plain = tok(PROMPTS[0], add_special_tokens=False).input_ids
    engine.add_request("nospecial", PROMPTS[0], greedy(1),
                       tokenization_kwargs={"add_special_tokens": False})
    assert engine.scheduler.requests["nospecial"].prompt_token_ids == plain
    drain(engine)


def test_priority_is_honoured_by_the_priority_policy():
    engine = LLMEngine(device="cpu", block_size=8, num_kv_blocks=32, policy="priority",
                       max_num_seqs=1)
    engine.add_request("late", PROMPTS[0], greedy(2), priority=5)
    engine.add_request("urgent", PROMPTS[1], greedy(2), priority=-1)
    first = engine.step()  # max_num_seqs=1: the smaller priority value goes first
    assert engine.history[-1].scheduler_output.scheduled[0].request_id == "urgent"
    drain(engine)
    assert first == [] or all(o.request_id == "urgent" for o in first)


def test_abort_many_and_the_accessors(llm):
    engine = llm.engine
    for rid in "abc":
        engine.add_request(rid, PROMPTS[0], greedy(20, ignore_eos=True))
    engine.step()
    engine.abort_request(iter(["a", "b", "never-added"]))
    assert engine.get_num_unfinished_requests() == 1 and engine.has_unfinished_requests()
    assert engine.get_unfinished_request_ids() == ["c"]
    outs = drain(engine)
    assert {o.request_id for o in outs} == {"c"}  # an aborted request gives no output (vLLM's rule)
    finished = {e.request_id: e.reason for rec in engine.history for e in rec.request_events
                if isinstance(e, RequestFinished)}
    assert finished["a"] == finished["b"] == "abort"  # the history records the aborts
    assert engine.get_model_config() is engine.model_config
    assert engine.get_tokenizer() is engine.tokenizer
    assert engine.get_engine_config().block_size == 8 and llm.llm_engine is engine


# --------------------------------------------------------------------- the context limit
def test_max_tokens_beyond_the_context_stops_at_the_context():
    limit = 24
    llm = LLM(device="cpu", block_size=4, num_kv_blocks=32, max_model_len=limit)
    prompt = llm.get_tokenizer()(PROMPTS[1]).input_ids
    (out,) = llm.generate([prompt], greedy(10_000, ignore_eos=True), use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(prompt) + len(c.token_ids) == limit
    assert max(s.seq_len for r in llm.engine.history for s in r.scheduler_output.scheduled) < limit


# ---------------------------------------------------------------------------- EngineArgs
def test_engine_args_round_trip_through_the_command_line():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    flags = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(EngineConfig):  # every option has exactly one flag, with help
        assert f.name in flags and flags[f.name].help, f.name
    assert EngineArgs.from_cli_args(parser.parse_args([])).create_engine_config() == EngineConfig()
    ns = parser.parse_args(["--block-size", "8", "--no-enable-prefix-caching", "--policy",
                            "priority", "--max-logprobs", "5", "--gpu-memory-utilization", "0.5"])
    config = EngineArgs.from_cli_args(ns).create_engine_config()
    assert type(config) is EngineConfig
    assert (config.block_size, config.enable_prefix_caching, config.policy, config.max_logprobs,
            config.gpu_memory_utilization) == (8, False, "priority", 5, 0.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float8"])
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        EngineArgs(block_size=0)
    mine = Collect()
    engine = LLMEngine.from_engine_args(EngineArgs(device="cpu", block_size=8, num_kv_blocks=16),
                                        stat_loggers={"mine": mine})
    assert (engine.kv_cache.num_blocks, engine.kv_cache.block_size) == (16, 8)
    # vLLM V1's StatLoggerManager: custom loggers join the default ones (stat logging is on).
    assert engine.stat_loggers["mine"] is mine and set(engine.stat_loggers) == {"logging", "mine"}


def test_max_logprobs_reaches_the_input_processor():
    engine = LLMEngine(device="cpu", block_size=8, num_kv_blocks=16, max_logprobs=3)
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request("x", PROMPTS[0], greedy(2, logprobs=4))
    engine.add_request("ok", PROMPTS[0], greedy(2, logprobs=3))
    (out,) = [o for o in drain(engine) if o.finished]
    assert all(len(d) >= 3 for d in out.outputs[0].logprobs)


# ------------------------------------------------------------------------- stat loggers
class Collect(StatLoggerBase):
    def __init__(self):
        self.steps: list[tuple[SchedulerStats, IterationStats]] = []
        self.logged = 0

    def record(self, scheduler_stats, iteration_stats):
        self.steps.append((scheduler_stats, iteration_stats))

    def log(self):
        self.logged += 1


def test_stat_loggers_see_every_step_and_prometheus_uses_vllm_names(llm):
    engine = llm.engine
    mine, prom = Collect(), PrometheusStatLogger("tiny")
    other = PrometheusStatLogger("tiny")  # a second exporter in the process: no clash
    engine.add_logger("mine", mine)
    engine.add_logger("prom", prom)
    with pytest.raises(KeyError, match="already exists"):
        engine.add_logger("mine", Collect())
    steps_before = len(engine.history)
    try:
        params = [greedy(6, ignore_eos=True), greedy(3), greedy(9, ignore_eos=True), greedy(4)]
        for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
            engine.add_request(f"s{i}", prompt, p)
        engine.add_request("gone", PROMPTS[0], greedy(30, ignore_eos=True))
        seen = {o.request_id: o for o in engine.step()}
        engine.abort_request("gone")  # no output from now on (vLLM's rule); the stats count it
        outs = [o for o in drain(engine) if o.finished]
        logged = mine.logged  # steps also log every log_stats_interval (vLLM's)
        engine.do_log_stats()
    finally:
        engine.remove_logger("mine")
        engine.remove_logger("prom")
    with pytest.raises(KeyError, match="does not exist"):
        engine.remove_logger("mine")
    assert mine.logged == logged + 1 and len(mine.steps) == len(engine.history) - steps_before
    iters = [it for _, it in mine.steps]
    done = {o.request_id: o for o in outs}
    if "gone" in seen:  # its tokens before the abort
        done["gone"] = seen["gone"]
    n_tokens = {rid: len(o.outputs[0].token_ids) for rid, o in done.items()}
    n_prompt = {rid: len(o.prompt_token_ids) for rid, o in done.items()}
    got_a_token = [rid for rid in done if n_tokens[rid]]
    assert sum(it.num_generation_tokens for it in iters) == sum(n_tokens.values())
    assert sum(it.num_prompt_tokens for it in iters) == sum(n_prompt[r] for r in got_a_token)
    assert len([t for it in iters for t in it.time_to_first_tokens_iter]) == len(got_a_token)
    itls = [t for it in iters for t in it.inter_token_latencies_iter]
    assert len(itls) == sum(n_tokens.values()) - len(got_a_token) and min(itls) >= 0
    finished = [f for it in iters for f in it.finished_requests]
    assert sorted(f.finish_reason for f in finished) == sorted(
        [o.outputs[0].finish_reason for o in outs] + ["abort"])
    for f in finished:
        assert f.e2e_latency >= f.queued_time >= 0 and f.e2e_latency >= f.inference_time >= 0
        assert f.e2e_latency >= f.time_to_first_token >= f.queued_time
        assert f.inference_time == pytest.approx(f.prefill_time + f.decode_time)
    assert mine.steps[-1][0].num_running_reqs == 0 and mine.steps[-1][0].kv_cache_usage == 0.0

    samples = {}
    for family in text_string_to_metric_families(generate_latest(prom.registry).decode()):
        for s in family.samples:
            assert s.labels["model_name"] == "tiny"
            samples[(s.name, s.labels.get("finished_reason"))] = s.value
    assert samples[("vllm:generation_tokens_total", None)] == sum(n_tokens.values())
    assert samples[("vllm:prompt_tokens_total", None)] == sum(n_prompt[r] for r in got_a_token)
    reasons = [o.outputs[0].finish_reason for o in outs] + ["abort"]
    for reason in ("stop", "length", "abort"):
        assert samples[("vllm:request_success_total", reason)] == reasons.count(reason)
    assert samples[("vllm:time_to_first_token_seconds_count", None)] == len(got_a_token)
    assert samples[("vllm:inter_token_latency_seconds_count", None)] == len(itls)
    assert samples[("vllm:e2e_request_latency_seconds_count", None)] == len(outs) + 1
    assert samples[("vllm:num_requests_running", None)] == 0
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:time_per_output_token_seconds_count",
                 "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                 "vllm:request_decode_time_seconds_count", "vllm:request_prompt_tokens_count",
                 "vllm:request_generation_tokens_count", "vllm:iteration_tokens_total_count"):
        assert (name, None) in samples, name
    assert "vllm:generation_tokens_total" in generate_latest(other.registry).decode()
    assert 'vllm:generation_tokens_total{model_name="tiny"} 0.0' in generate_latest(
        other.registry).decode()


def test_prefix_and_preemption_counters_match_the_kv_cache_and_history():
    engine = LLMEngine(device="cpu", block_size=4, num_kv_blocks=12, max_num_batched_tokens=16)
    mine = Collect()
    engine.add_logger("mine", mine)
    prompts = ["KING HENRY:\nOnce more unto the breach", "HAMLET:\nTo be, or not to be"]
    for i, prompt in enumerate(prompts * 2):
        engine.add_request(f"r{i}", prompt, greedy(12, ignore_eos=True))
    drain(engine)
    scheds = [s for s, _ in mine.steps]
    stats = engine.kv_cache.prefix_cache_stats
    assert sum(s.prefix_cache_queries for s in scheds) == stats.queries
    assert sum(s.prefix_cache_hits for s in scheds) == stats.hits > 0
    preempted = engine.history.to_dataframe()["preempted"].sum()
    assert sum(s.num_preemptions for s in scheds) == preempted > 0


# ----------------------------------------------------------------------- fault isolation
def run_with_fault(llm, faulty_params, install_fault=None):
    """Run PROMPTS plus one faulty request; return (outputs by id, the faulty output)."""
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"ok{i}", prompt, greedy(10, ignore_eos=True, output_kind=KINDS.FINAL_ONLY))
    engine.add_request("faulty", PROMPTS[1], faulty_params)
    if install_fault:
        install_fault(engine)
    outs = {o.request_id: o for o in drain(engine) if o.finished}
    engine.kv_cache.check_invariants(engine.scheduler.requests.values(), {})
    return outs


@pytest.fixture(scope="module")
def alone(llm):
    """The fault-free reference: the PROMPTS generated without any faulty neighbour."""
    return final_alone(llm, PROMPTS, greedy(10, ignore_eos=True))


def assert_others_unaffected(alone, outs):
    for i, ref in enumerate(alone):
        got = outs[f"ok{i}"]
        assert got.error is None and got.outputs[0].token_ids == ref.token_ids
        assert got.outputs[0].finish_reason == "length"


def test_a_raising_logits_processor_fails_only_its_request(llm, alone):
    calls = []

    def explode_on_third_step(output_token_ids, logits):
        calls.append(len(output_token_ids))
        if len(output_token_ids) == 2:
            raise RuntimeError("boom in a logits processor")
        return logits

    params = greedy(10, ignore_eos=True, logits_processors=[explode_on_third_step])
    outs = run_with_fault(llm, params)
    bad = outs["faulty"]
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert bad.error == "RuntimeError: boom in a logits processor"
    assert calls == [0, 1, 2]  # finished at once: never called again
    assert_others_unaffected(alone, outs)


def test_a_detokenizer_fault_fails_only_its_request(llm, alone, caplog):
    def install(engine):
        _, state = engine.output_processor._sequences["faulty"]
        real = state.detokenizer.update

        def update(ids):
            if state.detokenizer.num_output_tokens >= 3:
                raise UnicodeError("cannot decode this")
            return real(ids)

        state.detokenizer.update = update

    with caplog.at_level("ERROR", logger="workbench"):
        outs = run_with_fault(llm, greedy(10, ignore_eos=True), install)
    bad = outs["faulty"]
    assert bad.outputs[0].finish_reason == "error" and bad.error == "UnicodeError: cannot decode this"
    # The result keeps what was processed before the failure: 3 tokens and their text.
    (reference,) = final_alone(llm, [PROMPTS[1]], greedy(3, ignore_eos=True))
    assert bad.outputs[0].token_ids == reference.token_ids
    assert bad.outputs[0].text == reference.text
    assert caplog.text.count("request 'faulty' failed") == 1 and "Traceback" in caplog.text
    assert_others_unaffected(alone, outs)
    assert "faulty" in llm.engine.history[-1].finished_request_ids or any(
        "faulty" in r.finished_request_ids for r in llm.engine.history)


def test_a_failed_delta_stream_ends_with_an_error_output(llm):
    def boom(output_token_ids, logits):
        if output_token_ids:
            raise ValueError("bad row")
        return logits

    engine = llm.engine
    engine.add_request("d", PROMPTS[0], greedy(6, ignore_eos=True, output_kind=KINDS.DELTA,
                                                logits_processors=[boom]))
    outs = drain(engine)
    assert [o.finished for o in outs] == [False, True]
    assert outs[0].outputs[0].token_ids and outs[-1].outputs[0].finish_reason == "error"
    assert outs[-1].outputs[0].token_ids == [] and outs[-1].error == "ValueError: bad row"
    (first,) = final_alone(llm, [PROMPTS[0]], greedy(1))
    assert "".join(o.outputs[0].text for o in outs) == first.text


def test_a_forward_pass_failure_stops_the_step(llm, monkeypatch):
    engine = llm.engine

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    engine.add_request("x", PROMPTS[0], greedy(2))
    monkeypatch.setattr(engine.runner.model, "forward", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    monkeypatch.undo()
    engine.abort_request("x")
    drain(engine, check=False)


def test_an_output_building_fault_fails_only_its_request(llm, alone):
    def install(engine):
        parent = engine.output_processor.parents["faulty"]
        real, calls = parent.make_output, []

        def make_output():
            calls.append(1)
            if len(calls) == 3:
                raise KeyError("no such field")
            return real()

        parent.make_output = make_output

    outs = run_with_fault(llm, greedy(10, ignore_eos=True), install)
    bad = outs["faulty"]
    assert bad.finished and bad.error == "KeyError: 'no such field'"
    assert [c.finish_reason for c in bad.outputs] == ["error"]
    assert_others_unaffected(alone, outs)


def test_a_failed_first_sequence_still_lets_its_siblings_run(llm):
    calls = []

    def fail_first_call(output_token_ids, logits):
        calls.append(len(output_token_ids))
        if len(calls) == 1:
            raise RuntimeError("first sample")
        return logits

    engine = llm.engine
    engine.add_request("fam", PROMPTS[0], SamplingParams(
        n=3, temperature=0, max_tokens=4, ignore_eos=True, logits_processors=[fail_first_call],
        output_kind=KINDS.FINAL_ONLY))
    (out,) = drain(engine)
    assert [c.finish_reason for c in out.outputs] == ["error", "length", "length"]
    (alone,) = final_alone(llm, [PROMPTS[0]], greedy(4, ignore_eos=True))
    assert out.outputs[1].token_ids == out.outputs[2].token_ids == alone.token_ids
    assert out.error == "RuntimeError: first sample"


def test_prometheus_buckets_and_values_by_hand():
    prom = PrometheusStatLogger("m", max_model_len=300)
    prom.record(SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25,
                               prefix_cache_queries=40, prefix_cache_hits=16, num_preemptions=1),
                IterationStats(num_prompt_tokens=30, num_generation_tokens=2,
                               time_to_first_tokens_iter=[0.03], inter_token_latencies_iter=[0.004]))
    text = generate_latest(prom.registry).decode()
    for line in ('vllm:num_requests_running{model_name="m"} 2.0',
                 'vllm:kv_cache_usage_perc{model_name="m"} 0.25',
                 'vllm:prefix_cache_queries_total{model_name="m"} 40.0',
                 'vllm:prefix_cache_hits_total{model_name="m"} 16.0',
                 'vllm:num_preemptions_total{model_name="m"} 1.0',
                 # 0.03 s falls in the 0.05 bucket, not in 0.02; 32 iteration tokens in 32
                 'vllm:time_to_first_token_seconds_bucket{le="0.02",model_name="m"} 0.0',
                 'vllm:time_to_first_token_seconds_bucket{le="0.05",model_name="m"} 1.0',
                 'vllm:inter_token_latency_seconds_bucket{le="0.005",model_name="m"} 1.0',
                 'vllm:iteration_tokens_total_bucket{le="16.0",model_name="m"} 0.0',
                 'vllm:iteration_tokens_total_bucket{le="32.0",model_name="m"} 1.0',
                 'vllm:request_prompt_tokens_bucket{le="200.0",model_name="m"} 0.0'):
        assert line in text, line
    assert 'vllm:request_prompt_tokens_bucket{le="500.0"' not in text  # capped at max_model_len
