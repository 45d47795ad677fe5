"""Does the cost model describe this machine? The probe, the scaled model, the prediction band
and the recalibration from the workload's first real run, and the accuracy report's verdict."""

import math

import numpy as np
import pandas as pd
import pytest

from workbench import SamplingParams, Workload, WorkloadRequest
from workbench.lab.sim import FEATURES, CostModel, Probe, probe_machine, simulate
from workbench.lab.sim.accuracy import AccuracyReport, accuracy, band_factors, fraction_in_band
from workbench.lab.sim.probe import CALIBRATE_COMMAND


def test_a_scaled_model_predicts_every_time_times_the_factor():
    model = CostModel({"step": 0.002, "prefill_tokens": 1e-5}, empty_step_s=0.001, wake_s=0.004, input_s=(1e-4, 1e-6))
    x = np.zeros((2, len(FEATURES)))  # a prefill step and a decode step (the first 8 features)
    x[:, :8] = [[1, 1, 100, 1, 0, 0, 0, 0], [1, 0, 0, 0, 4, 2, 64, 0]]
    assert model.scaled(3.0).predict_many(x) == pytest.approx(3.0 * model.predict_many(x))
    s = model.scaled(3.0)
    assert (s.empty_step_s, s.wake_s) == pytest.approx((0.003, 0.012))
    assert s.input_s == pytest.approx((3e-4, 3e-6))
    with pytest.raises(ValueError, match="factor must be a finite number > 0"):
        model.scaled(0)


def test_probe_messages_name_the_ratio_and_the_calibrate_command():
    near = Probe(ratio=1.2, spread=(0.9, 1.5), steps=20, hardware="AMD EPYC, 2 threads")
    assert near.ok and "within 25%" in near.message()
    slow = Probe(ratio=4.0, spread=(3.0, 6.0), steps=20, hardware="AMD EPYC, 2 threads")
    assert not slow.ok and "4.00x slower" in slow.message() and CALIBRATE_COMMAND in slow.message()
    fast = Probe(ratio=0.5, spread=(0.4, 0.6), steps=20, hardware="x")
    assert "2.00x faster" in fast.message()


def test_probe_warns_when_the_model_describes_another_machine():
    # Predictions 10^4 times the shipped model's: no machine that runs the tests is that slow.
    model = CostModel.default().scaled(1e4)
    with pytest.warns(UserWarning, match="faster than the model describes.*workbench calibrate"):
        probe = probe_machine(model, {"max_num_seqs": 4, "num_kv_blocks": 32}, num_requests=3)
    assert probe.steps > 0 and 0 < probe.ratio < 0.75 and probe.spread[0] <= probe.ratio <= probe.spread[1]


def test_band_factors_from_the_calibration_residuals():
    assert band_factors(CostModel({"step": 1.0}, fit_stats={"ratio_p10": 0.9, "ratio_p90": 1.3})) == (0.9, 1.3)
    assert band_factors(CostModel({"step": 1.0}, fit_stats={"p90_abs_rel_err": 0.2})) == pytest.approx((0.8, 1.2))
    n = 2 * len(FEATURES)  # one decode step measured n times: every other one twice as long
    x = np.zeros((n, len(FEATURES)))
    x[:, :8] = [1, 0, 0, 0, 1, 1, 10, 0]
    fitted = CostModel.fit_measured(x, np.array([1.0, 2.0] * len(FEATURES)))
    assert fitted.fit_stats["ratio_p10"] <= 1.0 <= fitted.fit_stats["ratio_p90"]


def test_fraction_in_band_by_hand():
    class Run:
        def __init__(self, values):
            self.requests = pd.DataFrame({"request_id": ["a", "b", "c", "d"], "e2e_s": values})

    real = pd.Series([1.0, 2.0, 3.0, float("nan")], index=["a", "b", "c", "d"])
    # a inside [0.9, 1.1]; b above [1.5, 1.9]; c inside [3.0, 3.0] (ends count); d has no real value.
    assert fraction_in_band(real, Run([0.9, 1.5, 3.0, 1.0]), Run([1.1, 1.9, 3.0, 2.0]), "e2e_s") == pytest.approx(2 / 3)


def test_report_good_is_every_error_within_its_floor():
    table = pd.DataFrame({"ttft_err_median": [0.03, 0.2], "e2e_err_median": [0.02, 0.1],
                          "ttft_within_floor": [True, False], "e2e_within_floor": [True, True],
                          "schedule_identical": [True, True], "step_real_over_model": [1.0, 1.0]},
                         index=["calm", "busy"])
    assert not AccuracyReport(table).good and AccuracyReport(table.loc[["calm"]]).good


def test_accuracy_reports_floor_verdicts_band_and_recalibration():
    def req(rid, n, m, t):
        return WorkloadRequest(rid, tuple(range(5, 5 + n)), SamplingParams(temperature=0, max_tokens=m, ignore_eos=True),
                               arrival_step=int(t * 10), arrival_time=t)

    wl = Workload([req("a", 12, 4, 0.0), req("b", 20, 3, 0.05), req("c", 16, 5, 0.1)])
    model = CostModel.default()
    report = accuracy(model, {"max_num_seqs": 4}, workloads={"tiny": wl}, repeats=2)
    row = report.table.loc["tiny"]
    assert bool(row["ttft_within_floor"]) == (row["ttft_err_median"] <= row["ttft_floor"])
    assert bool(row["e2e_within_floor"]) == (row["e2e_err_median"] <= row["e2e_floor"])
    assert (row["band_low"], row["band_high"]) == pytest.approx(band_factors(model))
    assert 0.0 <= row["e2e_in_band"] <= 1.0
    assert row["recal_factor"] > 0 and math.isfinite(row["e2e_err_recal"])
    assert bool(row["e2e_recal_within_floor"]) == (row["e2e_err_recal"] <= row["e2e_floor"])
    assert row["recal_prefill_x"] > 0 and row["recal_other_x"] > 0
    assert "within the real-vs-real floor" in report._repr_html_()
