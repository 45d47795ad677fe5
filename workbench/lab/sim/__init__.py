"""Simulation on the real scheduler: a runner that predicts time, calibrated from real steps.

``simulate(workload, config, cost_model)`` -> RunResult (as ``run_workload``); ``CostModel``
(fit / predict / save / load); ``SimulatedRunner`` and ``SimClock`` (what an engine is built
with for a simulation); ``calibrate`` (designed batches on a real engine -> CostModel);
``accuracy`` (simulated vs real latencies on fresh workloads); ``probe_machine`` (does the cost
model describe this machine?); ``SpecDecodeProfile`` (speculative decoding's acceptance,
measured on a real run, drawn in a simulation).
"""

from workbench.lab.sim.accuracy import AccuracyReport, accuracy
from workbench.lab.sim.calibrate import CalibrationGrid, calibrate
from workbench.lab.sim.clock import SimClock
from workbench.lab.sim.cost_model import CostModel
from workbench.lab.sim.features import FEATURES, step_features
from workbench.lab.sim.probe import Probe, probe_machine
from workbench.lab.sim.simulate import simulate
from workbench.lab.sim.simulated_runner import SimulatedRunner
from workbench.lab.sim.spec_decode import SpecDecodeProfile

__all__ = ["FEATURES", "AccuracyReport", "CalibrationGrid", "CostModel", "Probe", "SimClock", "SimulatedRunner",
           "SpecDecodeProfile", "accuracy", "calibrate", "probe_machine", "simulate", "step_features"]
