"""probe_machine(): does the cost model describe this machine? A few seconds of real steps.

A cost model is fitted on one machine at one moment; on another machine (or the same one
under other load) every step takes another time, and a simulation is off by that factor
without saying so. The probe runs a small workload on the real engine (once to warm up, then
timed, step clock), and compares each measured step with the model's prediction: the median
of measured / predicted is ``ratio`` (1.0: the model describes this machine now). More than
:data:`TOLERANCE` off 1 warns, with the command that calibrates this machine.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from workbench.config import EngineConfig
from workbench.engine.llm_engine import LLMEngine
from workbench.lab.replay import replay_workload
from workbench.lab.run import resolve_config
from workbench.lab.sim.cost_model import CostModel, as_cost_model
from workbench.lab.sim.measurements import measured_steps
from workbench.lab.workload import Workload

#: A ratio further than this from 1 warns: the model describes another machine (or load).
TOLERANCE = 0.25
CALIBRATE_COMMAND = "workbench calibrate --output my-cost-model.json"


@dataclass(frozen=True)
class Probe:
    """``ratio``: median measured / predicted step time over ``steps`` measured steps;
    ``spread``: their 10th and 90th percentiles; ``hardware``: what the model was calibrated on."""

    ratio: float
    spread: tuple[float, float]
    steps: int
    hardware: str

    @property
    def ok(self) -> bool:
        return abs(self.ratio - 1.0) <= TOLERANCE

    def message(self) -> str:
        pace = f"{self.ratio:.2f}x slower" if self.ratio > 1 else f"{1 / self.ratio:.2f}x faster"
        head = (f"real steps took {self.ratio:.2f}x the cost model's prediction here (median of {self.steps} steps, "
                f"p10..p90 {self.spread[0]:.2f}..{self.spread[1]:.2f}; the model was calibrated on {self.hardware})")
        if self.ok:
            return head + f": within {TOLERANCE:.0%}, the model describes this machine."
        return (head + f": this machine runs {pace} than the model describes (more than {TOLERANCE:.0%} off), and "
                f"simulated seconds are off by about that. Calibrate it: `{CALIBRATE_COMMAND}`, then "
                "simulate(..., cost_model='my-cost-model.json') (or `--cost-model my-cost-model.json`).")

    def __repr__(self) -> str:
        return f"Probe({self.message()})"


def probe_machine(cost_model: CostModel | str | None = None, config: EngineConfig | dict | None = None, *,
                  num_requests: int = 8, warn: bool = True, seed: int = 0) -> Probe:
    """Time ``num_requests`` requests (prompts 16..128 tokens, outputs 8..24, all arriving at
    once: prefills, then decode batches) on a real engine built from ``config`` and compare
    with ``cost_model``'s predictions (see the module docstring). ``warn``: a UserWarning when
    the ratio is more than :data:`TOLERANCE` off 1."""
    model = as_cost_model(cost_model)
    workload = Workload.burst(num_requests, input_len=(16, 128), output_len=(8, 24), seed=seed, text=False)
    engine = LLMEngine(resolve_config(config))
    replay_workload(engine, workload)  # first passes over new shapes pay one-time costs
    engine.reset_prefix_cache()
    x, y, empty = measured_steps(replay_workload(engine, workload).history)
    ratios = y[~empty] / model.predict_many(x[~empty])
    hw = model.hardware
    probe = Probe(ratio=float(np.median(ratios)),
                  spread=(float(np.quantile(ratios, 0.1)), float(np.quantile(ratios, 0.9))),
                  steps=int(len(ratios)), hardware=f"{hw.get('gpu') or hw.get('cpu', '?')}, {hw.get('threads', '?')} threads")
    if warn and not probe.ok:
        warnings.warn(probe.message(), stacklevel=2)
    return probe
