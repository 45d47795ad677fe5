"""The simulator and async scheduling: steps measured as a driver sees them (host work hidden
under the forward), a calibration in that mode, simulations that stay deterministic, and the
accuracy report run against the real async engine."""

import dataclasses
import math
import time

from workbench import LLMEngine, SamplingParams, Workload, simulate, teaching_config
from workbench.lab.sim import CostModel
from workbench.lab.sim.accuracy import accuracy
from workbench.lab.sim.calibrate import CalibrationGrid, calibrate
from workbench.lab.sim.measurements import measured_steps
from workbench.lab.workload import WorkloadRequest
from workbench.worker.model_runner import ModelRunner


class SlowRunner(ModelRunner):
    def execute(self, *args, **kwargs):
        time.sleep(0.02)
        return super().execute(*args, **kwargs)


def test_async_steps_add_up_to_the_runs_wall_time():
    """Measured from one update's end to the next, the steps of a run without idle gaps cover
    its wall time once: the host work under each forward is not counted twice."""
    engine = LLMEngine(teaching_config(async_scheduling=True), make_runner=SlowRunner)
    for i, prompt in enumerate(("ROMEO:", "JULIET:", "HAMLET:")):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - start
    _, durations, _ = measured_steps(engine.history)
    assert 0.9 * wall <= durations.sum() <= wall
    # the forwards run one after another inside the run, so together the steps cover them all;
    # one step alone may be shorter than its forward (its start hid under the update before)
    assert durations.sum() >= 0.02 * len(durations)


def test_calibrate_simulate_and_the_accuracy_report_with_async_scheduling(tmp_path):
    config = teaching_config(async_scheduling=True)
    grid = dataclasses.replace(CalibrationGrid.tiny(), idle_arrivals=1, idle_gaps=(0.01,), traffic=())
    model = calibrate(config, grid, progress=False)
    assert model.async_scheduling and "--async-scheduling" in model.note
    assert CostModel.load(model.save(tmp_path / "cm.json")).async_scheduling
    wl = Workload([WorkloadRequest(f"r{i}", tuple(range(5, 17 + 4 * i)),
                                   SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True),
                                   arrival_step=i, arrival_time=0.02 * i) for i in range(4)])
    runs = [simulate(wl, config, model) for _ in range(2)]
    assert runs[0].requests["e2e_s"].tolist() == runs[1].requests["e2e_s"].tolist()
    assert any(r.overlap.placeholders for r in runs[0].history)  # scheduled one step ahead
    row = accuracy(model, config, workloads={"tiny": wl}, repeats=1).table.loc["tiny"]
    assert math.isfinite(row["e2e_err_median"]) and row["steps_sim"] > 0
