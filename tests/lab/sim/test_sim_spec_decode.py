"""Speculative decoding in the simulator: the profile measured by hand, the draws against
their distribution, a schedule and its times by hand, exact output lengths, the calibration's
speculation phases and the accuracy report on one real run."""

import numpy as np
import pytest

from workbench.core.sched.output import ScheduledRequest, SchedulerOutput, SpecDecodeResult
from workbench.engine.history import StepRecord
from workbench.metrics.spec_stats import spec_decode_summary
from workbench.lab.compare import run_workload
from workbench.lab.sim import CalibrationGrid, CostModel, SpecDecodeProfile, simulate
from workbench.lab.sim.accuracy import accuracy
from workbench.lab.sim.features import FEATURES
from workbench.lab.sim.measurements import measured_steps
from workbench.lab.workload import Workload, WorkloadRequest
from workbench.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _record(step, results):
    chunks = tuple(ScheduledRequest(rid, 10, 1 + k, (5,) * (1 + k), (0, 1), False, True, spec_token_ids=(7,) * k)
                   for rid, k, _ in results)
    spec = {rid: SpecDecodeResult((7,) * k, a) for rid, k, a in results if k}
    return StepRecord(step, SchedulerOutput(step, chunks), None, {rid: 9 for rid, _, _ in results}, (),
                      spec_decode=spec)


def test_profile_by_hand():
    # 4 decode rows: (k=4, 2 accepted), (k=4, 0), (k=2, 2), and one with no drafts.
    records = [_record(0, [("a", 4, 2), ("b", 4, 0)]), _record(1, [("a", 2, 2), ("b", 0, 0)])]
    profile = SpecDecodeProfile.from_run(records)
    assert profile.draft_rate == 3 / 4
    # reached (earlier drafts all accepted): pos0 3 rows, pos1 2 (a, a), pos2 1 (a's first); pos3 none
    # accepted: pos0 2 (a, a), pos1 2, pos2 0 -> rates 2/3, 1, 0; pos 3 takes the last
    assert profile.acceptance_rates == pytest.approx((2 / 3, 1.0, 0.0))
    assert profile.rate(5) == 0.0
    assert profile.expected_accepted_length(4) == pytest.approx(1 + 2 / 3 + 2 / 3)
    with pytest.raises(ValueError, match="no drafts"):
        SpecDecodeProfile.from_run([_record(0, [("a", 0, 0)])])
    with pytest.raises(ValueError, match="acceptance_rates"):
        SpecDecodeProfile(0.5, (1.5,))


def test_draws_follow_the_rates():
    profile = SpecDecodeProfile(1.0, (0.5, 0.5))
    rng = np.random.default_rng(0)
    draws = np.array([profile.draw_accepted(2, rng) for _ in range(20_000)])
    freq = np.bincount(draws, minlength=3) / len(draws)
    assert freq == pytest.approx([0.5, 0.25, 0.25], abs=0.015)  # 0.015 is > 4 sigma at n=20000
    assert draws.mean() + 1 == pytest.approx(profile.expected_accepted_length(2), abs=0.02)


def test_a_speculating_schedule_and_its_times_by_hand():
    # Every draft accepted, drafts at every step, k=3: step 0 prefills 4 tokens (token 1); step 1
    # verifies 3 drafts -> 4 tokens (5); step 2 may draft only 3 more (max_tokens 9) -> 9, done.
    # Each step costs 10 ms + 1 ms per draft token: 0.010, 0.013, 0.013.
    wl = Workload([WorkloadRequest("a", (5, 6, 7, 8), SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                                   arrival_time=0.0)], clock="wall")
    model = CostModel({"step": 0.010, "spec_tokens": 0.001})
    sim = simulate(wl, {"speculative_config": NGRAM}, model, spec_profile=SpecDecodeProfile(1.0, (1.0,)))
    assert [r.scheduler_output.num_spec_tokens for r in sim.history] == [0, 3, 3]
    assert [r.spec_decode["a"].num_accepted for r in sim.history[1:]] == [3, 3]
    row = sim.requests.set_index("request_id").loc["a"]
    assert row["num_output_tokens"] == 9 and row["e2e_s"] == pytest.approx(0.036)
    with pytest.raises(ValueError, match="spec_profile"):
        simulate(wl, {"speculative_config": NGRAM}, model)


def test_drawn_acceptance_matches_the_profile_and_lengths_stay_exact():
    wl = Workload.poisson(60, rate=2.0, input_len=(8, 24), output_len=(20, 40), seed=5)
    profile = SpecDecodeProfile(0.6, (0.7, 0.5, 0.4))
    cfg = {"speculative_config": NGRAM, "max_num_seqs": 4}
    sim = simulate(wl, cfg, CostModel({"step": 0.01}), spec_profile=profile, output_len=(5, 30), seed=2)
    again = simulate(wl, cfg, CostModel({"step": 0.01}), spec_profile=profile, output_len=(5, 30), seed=2)
    assert [r.spec_decode for r in sim.history] == [r.spec_decode for r in again.history]  # seeded
    plain = simulate(wl, {"max_num_seqs": 4}, CostModel({"step": 0.01}), output_len=(5, 30), seed=2)
    cols = ["request_id", "num_output_tokens", "finish_reason"]
    assert sim.requests[cols].equals(plain.requests[cols])  # the drawn lengths, exactly, speculating or not
    assert sim.num_steps < plain.num_steps
    summary = spec_decode_summary(sim.history)
    assert summary["spec_num_drafts"] > 500
    # full drafts: 1 + E[accepted of 3]; the length cap's shorter drafts pull it a little lower
    assert summary["spec_mean_acceptance_length"] == pytest.approx(profile.expected_accepted_length(3), abs=0.15)


def test_calibration_speculates_and_the_accuracy_report_runs_with_speculation():
    grid = CalibrationGrid.tiny()
    kw = dict(max_num_seqs=8, num_tokens=4096, max_model_len=512, block_size=16, vocab_size=100)
    names = [name for name, _ in grid.phases(**kw, speculative=True)]
    assert [n for n in names if n.startswith("spec")] == ["spec b=1", "spec b=2"]
    assert not [n for n, _ in grid.phases(**kw) if n.startswith("spec")]
    phase = dict(grid.phases(**kw, speculative=True))["spec b=2"]
    run = run_workload(phase, {"speculative_config": NGRAM})
    x, _, _ = measured_steps(run.history)
    spec_steps = x[:, FEATURES.index("spec_tokens")] > 0
    assert 0 < spec_steps.sum() < len(x)  # steps that verify drafts beside steps that do not

    wl = Workload.poisson(3, rate=20.0, input_len=(16, 32), output_len=(24, 24), seed=7, clock="wall")
    report = accuracy(None, {"speculative_config": NGRAM}, workloads={"w": wl}, repeats=1)
    row = report.table.loc["w"]
    assert row["schedule_identical"] is None and np.isfinite(row["e2e_err_median"])
