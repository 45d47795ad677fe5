"""The recording layer on the real engine (embedded model, teaching config): on_step, time
travel through the KV pool, the requests DataFrame against the event log, run_workload /
replay / compare_runs."""

import logging
import math

import numpy as np
import pytest

from workbench import (LLMEngine, SamplingParams, Workload, WorkloadRequest, compare_runs, replay_workload,
                       run_workload, teaching_config)
from workbench.core.request_events import RequestArrived, RequestFinished, RequestFirstToken, RequestPreempted


@pytest.fixture(scope="module")
def burst():
    return Workload.burst(num_requests=8, input_len=(10, 36), output_len=(4, 12), priorities=(0, 1, 2), seed=5)


@pytest.fixture(scope="module")
def fcfs_run(burst):
    return run_workload(burst, teaching_config())


def test_on_step_snapshots_equal_the_replayed_pool_with_aborts_and_resets(caplog):
    engine = LLMEngine(teaching_config(num_kv_blocks=12))
    live = {}
    engine.on_step.append(lambda record: 1 / 0)  # a broken hook is logged, never fatal
    engine.on_step.append(lambda record: live.__setitem__(record.step, engine.kv_cache.snapshot()))
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    for i in range(3):
        engine.add_request(f"a{i}", "ROMEO:\nBut soft, what light through yonder window breaks?", params)
    with caplog.at_level(logging.ERROR, logger="workbench.engine.llm_engine"):
        for _ in range(3):
            engine.step()
    assert "on_step hook" in caplog.text and "ZeroDivisionError" in caplog.text
    engine.abort_request("a2")  # between steps: its block events land in the next record
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.reset_prefix_cache()
    engine.add_request("b", "JULIET:\nO Romeo, Romeo!", params)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(live) == len(engine.history) > 5
    for step, snapshot in live.items():
        assert engine.history.kv_state(step) == snapshot, step
    assert any(type(e).__name__ == "AllBlocksCleared" for r in engine.history for e in r.kv_events)
    assert engine.history.kv_state().num_free_blocks == 12


def test_the_timed_stages_cover_the_whole_step_hooks_included():
    """A record is complete when its observers see it (its ``record`` stage included); a slow
    on_step hook lands in the next step's ``driver`` time, and so in that step's measured
    duration: nothing between two steps' tokens goes unmeasured."""
    import time

    from workbench.engine.history import TIMING_STAGES
    from workbench.lab.sim.measurements import measured_steps

    engine = LLMEngine(teaching_config())
    seen = []
    engine.on_step.append(lambda record: (seen.append(set(record.timings)), time.sleep(0.03)))
    engine.add_request("a", "ROMEO:", SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
    spans = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        spans.append(time.perf_counter() - t0)
    assert all({"record", "output"} <= keys for keys in seen)
    records = list(engine.history)
    for record, after, span in zip(records, records[1:], spans):
        stages = sum(record.timings[k] for k in TIMING_STAGES)
        assert stages <= span - 0.03  # all but the observers, the hook among them
        assert span - stages <= after.timings["driver"] + 0.01  # they are in the next driver time
    _, durations, _ = measured_steps(engine.history)
    assert (durations[1:] >= 0.03).all()  # each holds the hook of the step before it
    assert durations[0] <= spans[0] - 0.03  # and the first holds none


def test_requests_dataframe_agrees_with_the_event_log(fcfs_run):
    """Each column recomputed by hand from the recorded request events."""
    frame = fcfs_run.requests.set_index("request_id")
    events = [e for r in fcfs_run.history for e in r.request_events]
    assert sorted(frame.index) == sorted(fcfs_run.workload.request_ids)
    for rid, row in frame.iterrows():
        mine = [e for e in events if e.request_id == rid]
        arrived = next(e for e in mine if isinstance(e, RequestArrived))
        first = next(e for e in mine if isinstance(e, RequestFirstToken))
        done = next(e for e in mine if isinstance(e, RequestFinished))
        first_chunk = next(e for e in mine if e.kind == "scheduled")
        assert row.arrival_step == arrived.step and row.first_token_step == first.step
        assert row.first_scheduled_step == first_chunk.step and row.finished_step == done.step
        assert row.ttft_steps == first.step - arrived.step + 1
        assert row.e2e_steps == done.step - arrived.step + 1
        assert row.ttft_s == pytest.approx(first.time - arrived.time)
        assert row.e2e_s == pytest.approx(done.time - arrived.time)
        assert row.queue_s == pytest.approx(first_chunk.time - arrived.time)
        n = done.num_output_tokens
        assert n == fcfs_run.workload[int(rid[1:])].params.max_tokens == row.num_output_tokens
        assert row.tpot_s == pytest.approx((done.time - first.time) / (n - 1))
        assert row.num_output_tokens == sum(e.kind == "scheduled" and e.samples for e in mine)
        assert row.num_preemptions == sum(isinstance(e, RequestPreempted) for e in mine)
        assert row.finish_reason == "length"
        assert len(fcfs_run.outputs[rid].outputs[0].token_ids) == n


def test_teaching_engine_shows_pressure_and_runs_are_deterministic(burst, fcfs_run):
    s = fcfs_run.summary()
    assert s["num_finished"] == 8 and s["num_preemptions"] >= 1
    assert any(c.is_prefill and not c.samples for r in fcfs_run.history for c in r.scheduler_output.scheduled)
    again = run_workload(burst, teaching_config())

    def batches(result):
        return [[(c.request_id, c.num_computed_tokens, c.num_new_tokens) for c in r.scheduler_output.scheduled]
                for r in result.history]

    assert batches(again) == batches(fcfs_run)
    steps = ["arrival_step", "first_token_step", "finished_step", "num_preemptions", "num_recomputed_tokens"]
    assert again.requests[steps].equals(fcfs_run.requests[steps])
    for p in (50, 90, 99):
        assert s[f"ttft_steps_p{p}"] == pytest.approx(np.percentile(fcfs_run.requests.ttft_steps.astype(float), p))
    assert s["output_tokens"] == sum(r.params.max_tokens for r in burst)
    assert s["throughput_tok_step"] == pytest.approx(s["output_tokens"] / len(fcfs_run.history))
    first, last = fcfs_run.history.steps[0], fcfs_run.history.steps[-1]
    assert first == 0 and fcfs_run.history.kv_state(last).num_free_blocks == 24
    assert repr(fcfs_run) == repr(again)  # plain repr: no wall times


def test_replay_on_a_used_engine_keeps_only_its_own_steps_and_rejects_bad_requests():
    engine = LLMEngine(teaching_config())
    engine.add_request("before", "ROMEO:", SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    n_before = len(engine.history)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    w = Workload([
        WorkloadRequest("x", "JULIET:\nAy me!", params, arrival_step=0),
        WorkloadRequest("huge", tuple([5] * 200), params, arrival_step=1),  # more than the 96-slot pool
        WorkloadRequest("y", "ROMEO:\nShe speaks.", params, arrival_step=3),
    ])
    result = replay_workload(engine, w)
    assert list(result.requests.request_id) == ["x", "y"]
    assert "huge" in result.rejected and "num_blocks=24" in result.rejected["huge"]
    assert result.history.steps[0] == n_before and result.requests.arrival_step.tolist() == [n_before, n_before + 3]
    assert result.history.kv_state(result.history.steps[0]) == engine.history.kv_state(n_before)
    assert len(engine.requests_dataframe()) == 3  # the engine's own frame has every request


def test_wall_clock_arrivals():
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)
    w = Workload([
        WorkloadRequest("early", "ROMEO:", params, arrival_time=0.0),
        WorkloadRequest("late", "JULIET:", params, arrival_time=0.3),
    ])
    result = run_workload(w, teaching_config(), clock="wall")
    rows = result.requests.set_index("request_id")
    assert rows.loc["late", "arrival_s"] == pytest.approx(0.3, abs=1e-6)
    assert rows.loc["late", "queue_s"] >= 0 and result.wall_s >= 0.3
    assert not math.isnan(result.summary()["throughput_tok_s"])
    assert w.clock == "wall" and result.clock == "wall"
    with pytest.raises(ValueError, match="arrivals are on the wall clock .* leave clock out"):
        run_workload(w, teaching_config(), clock="steps")
    with pytest.raises(ValueError, match="clock must be one of"):
        run_workload(w, teaching_config(), clock="cpu")


def test_compare_runs_table_and_cdf(burst, fcfs_run):
    import matplotlib.pyplot as plt

    cmp = compare_runs(burst, {"fcfs": {}, "spf": {"policy": "spf"}}, base=teaching_config())
    table = cmp.table
    assert list(table.index) == ["fcfs", "spf"]
    for col in ("ttft_s_p50", "tpot_s_p90", "e2e_s_p99", "throughput_tok_s", "num_preemptions",
                "num_recomputed_tokens", "prefix_hit_rate"):
        assert col in table.columns
    assert table.loc["fcfs", "ttft_steps_p90"] == fcfs_run.summary()["ttft_steps_p90"]  # same schedule
    assert cmp.results["spf"].config.policy == "spf"
    both = cmp.requests
    assert both.columns[0] == "config" and len(both) == 16
    assert both.groupby("config").num_output_tokens.sum().tolist() == [sum(r.params.max_tokens for r in burst)] * 2
    before = plt.get_fignums()
    fig = cmp.cdf_figure("ttft_steps")
    assert plt.get_fignums() == before  # not registered with pyplot
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["fcfs (8)", "spf (8)"]
    assert fig.axes[0].get_xlabel() == "time to first token (steps)"
    with pytest.raises(ValueError, match="metric must be one of"):
        cmp.cdf_figure("latency")
    with pytest.raises(ValueError, match=r"config 'bad': unknown EngineConfig field\(s\) \['polcy'\]"):
        compare_runs(burst, {"bad": {"polcy": "spf"}})


def test_step_clock_keeps_counting_while_the_engine_idles():
    engine = LLMEngine(teaching_config())
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)
    result = replay_workload(engine, [WorkloadRequest("a", "ROMEO:", params, arrival_step=0),
                            WorkloadRequest("b", "JULIET:", params, arrival_step=10)])
    # a: prefill+sample at step 0, decode+sample at 1; steps 2-9 run empty; b arrives at 10.
    assert [len(r.scheduler_output.scheduled) for r in result.history] == [1, 1] + [0] * 8 + [1, 1]
    assert result.requests[["arrival_step", "finished_step", "e2e_steps"]].values.tolist() == [[0, 1, 2], [10, 11, 2]]
    with pytest.raises(ValueError, match="workload must be a Workload or a list of WorkloadRequest"):
        replay_workload(engine, "r1")


def test_every_entry_point_runs_a_workload_on_its_own_clock():
    """The issue's case: 48 requests at a rate of 6. On the step clock (the default) they all
    arrive within the first steps, at step floor(t); on the wall clock over seconds, at t.
    run_workload, simulate, compare_runs, sweep and replay agree, and none of them runs a
    workload on the other clock."""
    import concurrent.futures
    import functools

    from workbench.lab.sim import CostModel, simulate
    from workbench.lab.sweep import sweep

    steps = Workload.poisson(num_requests=48, rate=6.0, input_len=(8, 16), output_len=2, seed=1, text=False)
    wall = Workload.poisson(num_requests=48, rate=6.0, input_len=(8, 16), output_len=2, seed=1, text=False,
                            clock="wall")
    assert (steps.clock, wall.clock) == ("steps", "wall")
    assert [r.arrival_time for r in steps] == [r.arrival_time for r in wall]  # the same draws
    last = wall[-1].arrival_time
    assert 5 < last < 12  # 47 gaps of mean 1/6: seconds on the wall clock, steps on the step clock
    ten_ms = CostModel({"step": 0.010})
    config = teaching_config(num_kv_blocks=64, max_num_seqs=8)
    for run in (run_workload(steps, config), simulate(steps, config, ten_ms),
                compare_runs(steps, {"a": config}, simulate=True, cost_model=ten_ms).results["a"]):
        arrivals = run.requests.set_index("request_id")["arrival_step"]
        assert run.clock == "steps"
        assert [arrivals[r.request_id] for r in steps] == [r.arrival_step for r in steps]
    timed = simulate(wall, config, ten_ms)
    arrivals = timed.requests.set_index("request_id")["arrival_s"]
    assert timed.clock == "wall"
    # added at the first 10 ms step boundary after its arrival time, stamped with that time
    assert [arrivals[r.request_id] for r in wall] == pytest.approx([r.arrival_time for r in wall], abs=1e-9)
    assert timed.wall_s > last
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        row = sweep(wall, [{"max_num_seqs": 8}], run=functools.partial(simulate, cost_model=ten_ms), base=config,
                    executor=executor, progress=False).iloc[0]
    assert row["error"] is None and row["ttft_s_p50"] == pytest.approx(timed.summary()["ttft_s_p50"])
    fix = r"leave clock out .* Workload.poisson\(\.\.\., clock='wall'\), a rate per second"
    with pytest.raises(ValueError, match=fix):
        run_workload(steps, config, clock="wall")
    with pytest.raises(ValueError, match=fix):
        simulate(steps, config, ten_ms, clock="wall")
    with pytest.raises(ValueError, match=fix):
        compare_runs(steps, {"a": config}, clock="wall")
    with pytest.raises(ValueError, match="arrivals are on the wall clock .* clock='steps'"):
        replay_workload(LLMEngine(config), wall, clock="steps")
