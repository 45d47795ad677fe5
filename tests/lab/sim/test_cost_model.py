"""CostModel: fit recovers known coefficients, predict, JSON round trip, errors that name the problem."""

import dataclasses
import json

import numpy as np
import pytest

from workbench.core.sched.output import ScheduledRequest, SchedulerOutput
from workbench.engine.history import StepRecord
from workbench.lab.sim import FEATURES, CostModel, step_features

TRUE = {"step": 2e-3, "prefill_step": 1e-3, "prefill_tokens": 5e-5, "prefill_chunks": 4e-4, "decode_seqs": 1e-4, "decode_seqs_sqrt": 3e-4, "decode_context": 2e-7,
        "prefill_attention": 1e-8, "spec_tokens": 6e-5, "spec_seqs": 2e-4, "after_prefill": 4e-4}


def _chunk(rid, computed, new, prefill, drafts=0):
    return ScheduledRequest(rid, computed, new + drafts, (5,) * (new + drafts), (0,), prefill, True,
                            spec_token_ids=(7,) * drafts)


def _record(step, chunks, seconds, driver=None):
    so = SchedulerOutput(step=step, scheduled=tuple(chunks))
    timings = {"schedule": seconds * 0.1, "forward": seconds * 0.9}
    if driver is not None:
        timings["driver"] = driver
    return StepRecord(step, so, None, {}, (), timings=timings)


def _synthetic(rng, n=120, noise=0.0, true=TRUE, prefill=True):
    records, before = [], False  # whether the step before ran a prefill
    for i in range(n):
        chunks = [_chunk(f"d{j}", int(rng.integers(1, 900)), 1, False, drafts=int(rng.integers(0, 5)) * (j % 3 == 0))
                  for j in range(int(rng.integers(0, 40)))]
        for j in range(int(rng.integers(0, 3)) if prefill else 0):
            chunks.append(_chunk(f"p{j}", int(rng.integers(0, 512)), int(rng.integers(1, 400)), True))
        if not chunks:
            chunks = [_chunk("d", 10, 1, False)]
        so = SchedulerOutput(i, tuple(chunks))
        exact = sum(true.get(f, 0.0) * x for f, x in zip(FEATURES, step_features(so, after_prefill=before)))
        before = any(c.is_prefill for c in chunks)
        records.append(_record(i, chunks, exact * (1 + noise * rng.standard_normal())))
    return records


def test_features_by_hand():
    so = SchedulerOutput(0, (_chunk("a", 10, 1, False), _chunk("b", 0, 4, True), _chunk("c", 16, 2, True)))
    # decode: 1 seq (sqrt 1) attending 11 tokens; prefill: 2 chunks, 4 tokens at 0 (4 * 2.5) + 2 tokens at 16 (2 * 17.5)
    assert step_features(so) == (1.0, 1.0, 6.0, 2.0, 1.0, 1.0, 11.0, 10.0 + 35.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    four = SchedulerOutput(0, tuple(_chunk(f"d{i}", 10, 1, False) for i in range(4)))
    assert step_features(four) == (1.0, 0.0, 0.0, 0.0, 4.0, 2.0, 44.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert step_features(four, after_prefill=True)[-1] == 1.0
    assert step_features(SchedulerOutput(0, ()), after_prefill=True) == (0.0,) * len(FEATURES)
    assert step_features(SchedulerOutput(0, ())) == (0.0,) * len(FEATURES)
    # speculation: two rows verify 3 and 1 drafts (their KV context counts the drafts too)
    spec = SchedulerOutput(0, (_chunk("a", 10, 1, False, drafts=3), _chunk("b", 20, 1, False, drafts=1),
                               _chunk("c", 5, 1, False)))
    assert step_features(spec)[:10] == (1.0, 0.0, 0.0, 0.0, 3.0, 3.0 ** 0.5, 14.0 + 22.0 + 6.0, 0.0, 4.0, 2.0)


def test_fit_recovers_known_coefficients():
    model = CostModel.fit(_synthetic(np.random.default_rng(0)), hardware={"cpu": "test"})
    for f in FEATURES:
        assert model.coefficients[f] == pytest.approx(TRUE.get(f, 0.0), rel=1e-6, abs=1e-12)
    assert model.fit_stats["r2"] == pytest.approx(1.0)
    assert model.fit_stats["median_abs_rel_err"] < 1e-9


def test_fit_with_noise_and_an_outlier_reports_residuals():
    records = _synthetic(np.random.default_rng(1), n=300, noise=0.02)
    spike = records[5]
    records[5] = _record(5, spike.scheduler_output.scheduled, 5.0)  # another process took the CPU
    model = CostModel.fit(records, hardware={"cpu": "test"})
    assert model.fit_stats["num_outliers"] >= 1
    assert model.coefficients["step"] == pytest.approx(TRUE["step"], rel=0.1)
    assert model.coefficients["prefill_tokens"] == pytest.approx(TRUE["prefill_tokens"], rel=0.1)
    assert 0.005 < model.fit_stats["median_abs_rel_err"] < 0.05
    assert model.fit_stats["total_measured_over_predicted"] > 1  # the spike's 5 s are not predicted


def test_rescaled_to_fits_a_prefill_factor_and_one_for_the_rest():
    from workbench.lab.sim.cost_model import PREFILL_FEATURES

    # This machine: prefill costs 1.5x the model's, everything else 0.8x; one step stalls.
    machine = {f: c * (1.5 if f in PREFILL_FEATURES else 0.8) for f, c in TRUE.items()}
    records = _synthetic(np.random.default_rng(2), n=200, true=machine)
    records[7] = _record(7, records[7].scheduler_output.scheduled, 3.0)
    model = CostModel(TRUE, empty_step_s=1e-4, wake_s=2e-3, input_s=(4e-4, 2e-6), note="test")
    rescaled = model.rescaled_to(records)
    assert rescaled.fit_stats["rescale_prefill"] == pytest.approx(1.5, rel=1e-6)
    assert rescaled.fit_stats["rescale_other"] == pytest.approx(0.8, rel=1e-6)
    for f in FEATURES:
        assert rescaled.coefficients[f] == pytest.approx(machine.get(f, 0.0), rel=1e-6, abs=1e-15)
    assert (rescaled.empty_step_s, rescaled.wake_s) == pytest.approx((0.8e-4, 1.6e-3))
    assert rescaled.input_s == pytest.approx((3.2e-4, 1.6e-6))
    assert "prefill x1.5, the rest x0.8" in rescaled.note
    # Without a prefill step the history says nothing apart about prefills: one factor for both.
    decode_only = model.rescaled_to(_synthetic(np.random.default_rng(3), true=machine, prefill=False))
    assert decode_only.fit_stats["rescale_prefill"] == decode_only.fit_stats["rescale_other"] == pytest.approx(0.8)
    with pytest.raises(ValueError, match="no measured step ran a batch"):
        model.rescaled_to([_record(0, (), 0.001)])


def test_driver_time_counts_in_the_duration():
    """A step's duration includes the driver's share; a step without it (the first of a run,
    or after idle) is its own stages only."""
    rng = np.random.default_rng(2)
    records = [_record(r.step, r.scheduler_output.scheduled, sum(r.timings.values()) - 1e-3, driver=1e-3)
               for r in _synthetic(rng)]
    records[0] = _record(0, records[0].scheduler_output.scheduled, sum(records[0].timings.values()))
    model = CostModel.fit(records, hardware={})
    assert model.coefficients["step"] == pytest.approx(TRUE["step"], rel=1e-6)


def test_predict_forms_agree():
    model = CostModel(TRUE, empty_step_s=1e-4)
    so = SchedulerOutput(0, (_chunk("a", 10, 1, False), _chunk("b", 0, 4, True)))
    expected = 2e-3 + 1e-3 + 5e-5 * 4 + 4e-4 + 1e-4 + 3e-4 * 1 + 2e-7 * 11 + 1e-8 * 10
    assert model.predict(so) == pytest.approx(expected)
    assert model.predict(dict(zip(FEATURES, step_features(so)))) == pytest.approx(expected)
    assert model.predict(SchedulerOutput(1, ())) == 1e-4
    with pytest.raises(ValueError, match="unknown feature"):
        model.predict({"tokens": 3})


def test_save_load_round_trip(tmp_path):
    model = CostModel.fit(_synthetic(np.random.default_rng(3)), hardware={"cpu": "X", "threads": 2},
                          model={"name": "m", "dtype": "float32"}, note="synthetic")
    path = model.save(tmp_path / "cm.json")
    again = CostModel.load(path)
    assert again == model
    data = json.loads(path.read_text())
    assert data["hardware"] == {"cpu": "X", "threads": 2} and data["model"]["name"] == "m"
    assert repr(again) == repr(model) and "model=m" in repr(model) and "hardware=X" in repr(model)
    assert "<table>" in model._repr_html_()


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        CostModel.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "workbench-cost-model/1", "coefficients": {"step": -1}}')
    with pytest.raises(ValueError, match=r"bad.json.*coefficients\['step'\]"):
        CostModel.load(bad)
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(ValueError, match="not a cost model"):
        CostModel.load(other)


def test_fit_refuses_unmeasured_histories():
    with pytest.raises(ValueError, match="no step with timings"):
        CostModel.fit([StepRecord(0, SchedulerOutput(0, ()), None, {}, ())])
    measured = _record(0, [_chunk("a", 1, 1, False)], 0.01)
    simulated = dataclasses.replace(measured, timings={**measured.timings, "simulated": 0.01})
    with pytest.raises(ValueError, match="simulated, not measured"):
        CostModel.fit([simulated])


def test_shipped_default_describes_the_embedded_model_on_cpu():
    model = CostModel.default()
    assert model.model["name"] == "tiny-shakespeare"
    assert model.hardware["device"] == "cpu"
    assert model.fit_stats["r2"] > 0.8
    assert all(v >= 0 for v in model.coefficients.values()) and model.coefficients["step"] > 0


def test_a_step_lasts_from_the_previous_tokens_to_its_own():
    """Tokens come at the end of ``sample``: the previous step's output and record stages and
    the driver's time count in the next step; the first step (or one after idle) is its own
    stages only."""
    from workbench.lab.sim.measurements import measured_steps

    chunk = [_chunk("a", 3, 1, False)]

    def rec(step, output, driver=None):
        timings = {"schedule": 0.001, "prepare": 0.001, "forward": 0.010, "sample": 0.002, "output": output,
                   "record": 0.0003}
        if driver is not None:
            timings["driver"] = driver
        return StepRecord(step, SchedulerOutput(step, tuple(chunk)), None, {}, (), timings=timings)

    _, durations, _ = measured_steps([rec(0, 0.004), rec(1, 0.006, driver=0.0005), rec(2, 0.002, driver=0.0007)])
    assert durations[1] == pytest.approx(0.014 + 0.0005 + 0.004 + 0.0003)
    assert durations[2] == pytest.approx(0.014 + 0.0007 + 0.006 + 0.0003)
    assert durations[0] == pytest.approx(0.014)  # before it: the wake-up and input costs (wake_s, input_s)


def test_input_cost_round_trips_and_is_checked(tmp_path):
    model = CostModel(TRUE, wake_s=0.002, input_s=(3e-4, 2e-6))
    assert model.input_cost([100, 10]) == pytest.approx(2 * 3e-4 + 110 * 2e-6)
    again = CostModel.load(model.save(tmp_path / "m.json"))
    assert again.input_s == (3e-4, 2e-6) and again.wake_s == 0.002
    assert "input_s=(0.0003, 2e-06)" in repr(again)
    with pytest.raises(ValueError, match="input_s must be"):
        CostModel(TRUE, input_s=(1e-3, -1.0))


def test_input_cost_is_fitted_from_the_drivers_time_per_arrival():
    """Driver time = 20 us + 300 us per arriving request + 2 us per prompt token (by hand)."""
    from workbench.lab.sim.calibrate import fit_input_cost

    rng = np.random.default_rng(5)
    n = rng.integers(0, 3, size=200)
    tokens = n * rng.integers(20, 400, size=200)
    driver = 2e-5 + 3e-4 * n + 2e-6 * tokens
    rows = np.column_stack([driver, n, tokens]).astype(float)
    rows[::7, 0] = np.nan  # steps after idle: no driver time recorded
    per_request, per_token = fit_input_cost(rows)
    assert per_request == pytest.approx(3e-4, rel=1e-6) and per_token == pytest.approx(2e-6, rel=1e-6)
    assert fit_input_cost(np.array([[1e-5, 0, 0]])) == (0.0, 0.0)  # no arrival: nothing to fit
