"""simulate(): the real scheduler with a simulated runner -- schedules, clocks, lengths, errors."""

import pytest

from workbench.lab.compare import run_workload
from workbench.sampling_params import SamplingParams
from workbench.lab.sim import CostModel, simulate
from workbench.lab.sim.accuracy import schedule_of
from workbench.lab.workload import Workload, WorkloadRequest

TEN_MS = CostModel({"step": 0.010})


def _req(rid, n_prompt, max_tokens, *, step=None, time=None, **params):
    params.setdefault("ignore_eos", True)
    return WorkloadRequest(rid, tuple(range(5, 5 + n_prompt)), SamplingParams(temperature=0, max_tokens=max_tokens, **params),
                           arrival_step=step, arrival_time=time)


def test_schedule_is_identical_to_a_real_run_with_preemption_chunking_and_prefix_hits():
    wl = Workload.poisson(10, rate=2.0, input_len=(36, 90), output_len=(4, 16), seed=3,
                          num_prefix_groups=2, prefix_len=32)
    cfg = {"max_num_seqs": 6, "num_kv_blocks": 16, "max_num_batched_tokens": 48}
    real = run_workload(wl, cfg, clock="steps")
    sim = simulate(wl, cfg, TEN_MS, clock="steps")
    summary = real.summary()
    assert summary["num_preemptions"] > 0 and summary["prefix_hit_rate"] > 0  # the cases are there
    assert any(s.is_prefill and s.num_computed_tokens for r in real.history for s in r.scheduler_output.scheduled)
    assert schedule_of(sim) == schedule_of(real)
    cols = ["request_id", "num_output_tokens", "ttft_steps", "e2e_steps", "num_preemptions",
            "num_recomputed_tokens", "num_cached_tokens", "finish_reason"]
    assert sim.requests[cols].equals(real.requests[cols])
    assert [r.kv_usage for r in sim.history] == [r.kv_usage for r in real.history]
    assert sim.simulated and "simulated" in repr(sim)


def test_constant_cost_by_hand_with_idle_jump():
    """Every step 10 ms. a (t=0): 3-token prompt, 3 outputs -> tokens at steps 0, 1, 2, ends at
    0.030. b arrives at 0.100 while the engine is idle: the clock jumps there; its tokens
    come at 0.110 and 0.120. c arrives at 0.015, during step 1: it is added at the boundary
    0.020, first token at 0.030 (ttft 0.015), second at 0.040 (e2e 0.025)."""
    wl = Workload([_req("a", 3, 3, time=0.0), _req("b", 4, 2, time=0.100), _req("c", 2, 2, time=0.015)])
    sim = simulate(wl, {"max_num_seqs": 4}, TEN_MS, clock="wall")
    rows = sim.requests.set_index("request_id")
    assert rows.loc["a", "ttft_s"] == pytest.approx(0.010)
    assert rows.loc["a", "e2e_s"] == pytest.approx(0.030)
    assert rows.loc["c", "queue_s"] == pytest.approx(0.005)
    assert rows.loc["c", "ttft_s"] == pytest.approx(0.015)
    assert rows.loc["c", "e2e_s"] == pytest.approx(0.025)
    assert rows.loc["b", "ttft_s"] == pytest.approx(0.010)
    assert rows.loc["b", "e2e_s"] == pytest.approx(0.020)
    assert sim.wall_s == pytest.approx(0.120)
    assert sim.num_steps == 6  # 4 busy steps before the idle gap, 2 after
    assert sim.summary()["throughput_tok_s"] == pytest.approx(7 / 0.120)
    # a simulated step's forward is the model's 10 ms; no stage is derived from it
    assert all(min(r.timings.values()) >= 0 for r in sim.history)
    assert all(r.timings["forward"] == 0.010 for r in sim.history if r.scheduler_output.scheduled)


def test_the_first_step_after_idle_pays_the_wake_up_cost():
    """As above with wake_s = 4 ms: only b arrives at an idle engine (a comes at the start,
    c while a runs), so only b's first step lasts 14 ms."""
    wl = Workload([_req("a", 3, 3, time=0.0), _req("b", 4, 2, time=0.100), _req("c", 2, 2, time=0.015)])
    woken = CostModel({"step": 0.010}, wake_s=0.004)
    rows = simulate(wl, {"max_num_seqs": 4}, woken, clock="wall").requests.set_index("request_id")
    assert rows.loc["a", "ttft_s"] == pytest.approx(0.010)
    assert rows.loc["c", "e2e_s"] == pytest.approx(0.025)
    assert rows.loc["b", "ttft_s"] == pytest.approx(0.014)
    assert rows.loc["b", "e2e_s"] == pytest.approx(0.024)
    assert CostModel.from_json(woken.to_json()).wake_s == 0.004


def test_the_step_after_a_prefill_pays_after_prefill():
    """As the constant-cost case with after_prefill = 3 ms: a prefills in step 0 and c in step 2
    (c arrives during step 1), b in step 4 after the idle gap; so steps 1, 3 and 5 last 13 ms.
    a: tokens at 0.010, 0.023, 0.033 (e2e); c: added at 0.023, first token 0.033, then 0.046."""
    wl = Workload([_req("a", 3, 3, time=0.0), _req("b", 4, 2, time=0.100), _req("c", 2, 2, time=0.015)])
    model = CostModel({"step": 0.010, "after_prefill": 0.003})
    sim = simulate(wl, {"max_num_seqs": 4}, model, clock="wall")
    prefills = [any(s.is_prefill for s in r.scheduler_output.scheduled) for r in sim.history]
    assert prefills == [True, False, True, False, True, False]
    assert [r.timings["forward"] for r in sim.history] == pytest.approx([0.010, 0.013] * 3)
    rows = sim.requests.set_index("request_id")
    assert rows.loc["a", "e2e_s"] == pytest.approx(0.033)
    assert rows.loc["c", "ttft_s"] == pytest.approx(0.033 - 0.015)
    assert rows.loc["c", "e2e_s"] == pytest.approx(0.046 - 0.015)
    assert rows.loc["b", "e2e_s"] == pytest.approx(0.023)


def test_text_prompts_pay_their_input_processing_before_their_step():
    """a (text) and b (token ids) arrive at an idle engine; only a's first step is preceded by
    the driver tokenizing it: 1 ms + 0.1 ms per prompt token."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    wl = Workload([WorkloadRequest("a", "ROMEO: what light", params, arrival_time=0.0),
                   WorkloadRequest("b", (5, 6, 7, 8), params, arrival_time=0.5)])
    model = CostModel({"step": 0.010}, input_s=(0.001, 0.0001))
    rows = simulate(wl, None, model, clock="wall").requests.set_index("request_id")
    n = rows.loc["a", "num_prompt_tokens"]
    assert rows.loc["a", "ttft_s"] == pytest.approx(0.010 + 0.001 + 0.0001 * n)
    assert rows.loc["a", "e2e_s"] == pytest.approx(0.020 + 0.001 + 0.0001 * n)
    assert rows.loc["b", "ttft_s"] == pytest.approx(0.010)


def test_drawn_output_lengths_end_with_eos_and_are_reproducible():
    wl = Workload([_req(f"r{i}", 6, 50, step=0, ignore_eos=False) for i in range(5)])
    one = simulate(wl, None, TEN_MS, clock="steps", output_len=(3, 9), seed=7)
    two = simulate(wl, None, TEN_MS, clock="steps", output_len=(3, 9), seed=7)
    lengths = one.requests.set_index("request_id")["num_output_tokens"]
    assert lengths.equals(two.requests.set_index("request_id")["num_output_tokens"])
    assert lengths.between(3, 9).all() and lengths.nunique() > 1
    assert set(one.requests["finish_reason"]) == {"stop"}
    capped = simulate(wl, None, TEN_MS, clock="steps", output_len=80)
    assert set(capped.requests["finish_reason"]) == {"length"}  # max_tokens=50 comes first


def test_fillers_never_stop_a_request_by_accident():
    """stop_token_ids cover the top of the vocabulary; stop strings need text: the run still
    goes to max_tokens."""
    stops = list(range(4000, 4096))
    wl = Workload([_req("ids", 4, 12, step=0, stop_token_ids=stops),
                   _req("text", 4, 12, step=0, stop=["e", "a", " "], ignore_eos=True)])
    sim = simulate(wl, None, TEN_MS, clock="steps")
    assert list(sim.requests["num_output_tokens"]) == [12, 12]
    assert set(sim.requests["finish_reason"]) == {"length"}


def test_errors_name_the_problem(tmp_path):
    open_ended = Workload([_req("r0", 4, 8, step=0, ignore_eos=False)])
    with pytest.raises(ValueError, match=r"1 request\(s\), the first 'r0', have no exact output length.*output_len"):
        simulate(open_ended, None, TEN_MS)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        simulate(open_ended, None, tmp_path / "missing.json")
    with pytest.raises(ValueError, match="logprobs are not simulated"):
        simulate(Workload([_req("r0", 4, 8, step=0, logprobs=2)]), None, TEN_MS)
    with pytest.raises(ValueError, match="unknown EngineConfig field"):
        simulate(open_ended, {"max_seqs": 3}, TEN_MS, output_len=4)


def test_simulate_is_picklable_for_process_pools():
    """A process pool pickles the function and its arguments: the round trip runs."""
    import pickle

    wl = Workload([_req("r0", 4, 3, step=0)])
    fn, args = pickle.loads(pickle.dumps((simulate, (wl, {"max_num_seqs": 2}, TEN_MS))))
    result = fn(*args, clock="steps")
    assert result.num_steps == 3 and result.simulated
    pickle.dumps(result.requests)


def test_compare_runs_and_widgets_read_simulated_runs():
    from workbench.lab.compare import compare_runs
    from workbench.viz import BlockMap, ComparisonView, RequestTimeline, StepPlayer

    wl = Workload.poisson(8, rate=1.0, input_len=(8, 40), output_len=(2, 8), seed=5, text=False)
    comparison = compare_runs(wl, {"fcfs": {"max_num_seqs": 4}, "spf": {"max_num_seqs": 4, "policy": "spf"}},
                              simulate=True, cost_model=TEN_MS)
    assert comparison.table.loc["fcfs", "num_finished"] == 8
    assert all(r.simulated for r in comparison.results.values())
    result = comparison.results["fcfs"]
    view = ComparisonView(comparison)
    assert view is not None
    StepPlayer(result, live_updates=False)
    RequestTimeline(result)
    BlockMap(result)
    comparison.cdf_figure("ttft_s")
    with pytest.raises(ValueError, match="only used with simulate=True"):
        compare_runs(wl, {"a": {}}, cost_model=TEN_MS)


def test_accuracy_report_on_a_tiny_workload():
    from workbench.lab.sim.accuracy import accuracy

    wl = Workload([_req("a", 12, 4, step=0, time=0.0), _req("b", 20, 3, step=1, time=0.05)])
    other_threads = CostModel({"step": 0.010}, hardware={"device": "cpu", "threads": 999})
    with pytest.warns(UserWarning, match="calibrated with 999 torch threads, this process uses"):
        report = accuracy(other_threads, {"max_num_seqs": 4}, workloads={"tiny": wl})
    row = report.table.loc["tiny"]
    assert bool(row["schedule_identical"]) and row["requests"] == 2
    assert row["ttft_err_median"] >= 0 and row["e2e_p50_sim_s"] > 0
    assert 0 < row["step_real_over_model"] < float("inf")  # measured over predicted (how fast: the machine's)
    assert "ttft_err_median" in repr(report) and "<table" in report._repr_html_()
    ratio = row["step_real_over_model"]  # the machine's pace decides the note, never the model
    if abs(ratio - 1) > 0.05:
        assert ("slower" if ratio > 1 else "faster") + " than the model describes" in repr(report)


def test_machine_notes_name_the_workloads_whose_steps_ran_off_the_model():
    import pandas as pd

    from workbench.lab.sim.accuracy import AccuracyReport

    table = pd.DataFrame({"step_real_over_model": [1.02, 1.12, 0.9]}, index=["steady", "slow", "fast"])
    notes = AccuracyReport(table).machine_notes()
    assert len(notes) == 2
    assert notes[0].startswith("slow: the real steps took 1.12x") and "ran 12% slower" in notes[0]
    assert notes[1].startswith("fast: the real steps took 0.90x") and "ran 10% faster" in notes[1]


def test_step_ratio_is_the_median_measured_over_predicted_step():
    """Steps of 1, 2, 3 and 8 ms against a 2 ms model: ratios 0.5, 1, 1.5, 4 (empty steps left
    out), median 1.25."""
    from workbench.core.sched.output import ScheduledRequest, SchedulerOutput
    from workbench.engine.history import StepRecord
    from workbench.lab.sim.accuracy import step_ratio

    def record(step, seconds, scheduled=True):
        chunks = (ScheduledRequest("a", 5, 1, (5,), (0,), False, True),) if scheduled else ()
        return StepRecord(step, SchedulerOutput(step, chunks), None, {}, (), timings={"forward": seconds})

    runs = [[record(0, 0.001), record(1, 0.002), record(2, 0.0005, scheduled=False)], [record(0, 0.003), record(1, 0.008)]]
    assert step_ratio(CostModel({"step": 0.002}), runs) == pytest.approx(1.25)


def test_pool_is_sized_like_a_real_engine_and_no_weights_load():
    from workbench.config import EngineConfig
    from workbench.engine.llm_engine import LLMEngine
    from workbench.lab.sim import SimClock, SimulatedRunner

    cfg = EngineConfig(kv_cache_memory_bytes=2**22)
    clock = SimClock()
    sim = LLMEngine(cfg, make_runner=SimulatedRunner.factory(TEN_MS, clock), clock=clock)
    real = LLMEngine(cfg)
    per_block = real.model_config.kv_cache_bytes_per_block(cfg.block_size)
    assert sim.kv_cache.num_blocks == real.kv_cache.num_blocks == 2**22 // per_block
    assert not hasattr(sim.runner, "model") and "SimulatedRunner(model=tiny-shakespeare" in repr(sim.runner)
    assert sim.clock is clock and repr(clock) == "SimClock(now=0.000000)"
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance(-1.0)


def test_a_gpu_engine_simulates_without_a_gpu():
    """device="cuda" sizes budgets as on a GPU (8192 tokens/step, 256 seqs); nothing touches CUDA."""
    wl = Workload([_req(f"r{i}", 600, 2, step=0) for i in range(12)])
    sim = simulate(wl, {"device": "cuda", "num_kv_blocks": 600}, TEN_MS, clock="steps")
    first = sim.history[0].scheduler_output
    assert first.token_budget == 8192 and len(first.scheduled) == 12  # all prompts in one step
    assert sim.num_steps == 2
