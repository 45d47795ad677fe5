"""accuracy(): simulated vs real runs of the same workloads, request by request.

For each workload (default: Poisson arrivals at two rates, mixed prompt and output lengths,
groups of requests sharing a prefix -- none of it what calibration ran) it runs the real
engine and the simulation with the same config:

* ``clock="wall"``: per-request TTFT and e2e latency; the error of a request is
  ``|simulated - real| / real``; the table gives the median over requests (target <= 5%);
* ``clock="steps"``: whether the step-by-step schedule (which request ran in which step,
  how many tokens, prefill or decode) is identical.

The real engine of the wall-clock run is warmed up first (a short run, then its prefix cache
emptied), as calibration's is: the first forward passes of a process pay one-time costs that
no step model describes. Real wall-clock figures move with the machine's load: run it on a
quiet machine.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import numpy as np

from workbench.config import EngineConfig
from workbench.workload import Workload


def default_workloads(num_requests: int = 40, rates: tuple[float, ...] = (4.0, 12.0)) -> dict[str, Workload]:
    """Poisson workloads at ``rates`` (requests/s): prompts 24..400 tokens, outputs 4..96,
    four 32-token shared prefixes; seeds other than calibration's."""
    return {
        f"poisson {rate:g}/s": Workload.poisson(num_requests, rate=rate, input_len=(40, 400), output_len=(4, 96),
                                                num_prefix_groups=4, prefix_len=32, seed=100 + i)
        for i, rate in enumerate(rates)
    }


def schedule_of(result) -> list[tuple[tuple[str, int, bool], ...]]:
    """Per step: (request id, tokens, prefill?) of every scheduled chunk."""
    return [tuple((s.request_id, s.num_new_tokens, s.is_prefill) for s in r.scheduler_output.scheduled)
            for r in result.history]


def latency_errors(real, simulated, metric: str) -> np.ndarray:
    """``|sim - real| / real`` of ``metric`` per request both runs finished (request order)."""
    a = real.requests.set_index("request_id")[metric].astype("float64")
    b = simulated.requests.set_index("request_id")[metric].astype("float64").reindex(a.index)
    ok = a.notna() & b.notna() & (a > 0)
    return (np.abs(b[ok] - a[ok]) / a[ok]).to_numpy()


@dataclass
class AccuracyReport:
    """One row per workload: median absolute relative errors of TTFT and e2e (clock="wall"),
    p50s real and simulated, and whether the clock="steps" schedules are identical."""

    table: object  # pandas DataFrame

    @property
    def ok(self) -> bool:
        """Every workload within 5% on both metrics, every schedule identical."""
        t = self.table
        return bool((t["ttft_err_median"] <= 0.05).all() and (t["e2e_err_median"] <= 0.05).all()
                    and t["schedule_identical"].all())

    def __repr__(self) -> str:
        return "AccuracyReport\n" + self.table.to_string(float_format=lambda v: f"{v:.4g}")

    def _repr_html_(self) -> str:
        return "<b>AccuracyReport</b>" + self.table.to_html(float_format=lambda v: f"{v:.4g}") + \
            f"<p>within 5% and identical schedules: {html.escape(str(self.ok))}</p>"


def accuracy(cost_model=None, config: EngineConfig | dict | None = None, *,
             workloads: dict[str, Workload] | None = None, progress: bool = False) -> AccuracyReport:
    """Run each workload real and simulated (both clocks); see the module docstring."""
    import pandas as pd

    from workbench.compare import run_workload
    from workbench.engine import LLMEngine
    from workbench.run import resolve_config
    from workbench.sim.cost_model import as_cost_model
    from workbench.sim.simulate import simulate

    model = as_cost_model(cost_model)
    rows = []
    for name, workload in (workloads or default_workloads()).items():
        engine = LLMEngine(resolve_config(config))
        engine.replay(Workload.poisson(4, rate=1.0, input_len=(8, 64), output_len=(2, 8), seed=0, text=False))
        engine.reset_prefix_cache()
        real = engine.replay(workload, clock="wall", progress=progress)
        sim = simulate(workload, config, model, clock="wall")
        ttft, e2e = latency_errors(real, sim, "ttft_s"), latency_errors(real, sim, "e2e_s")
        same = schedule_of(run_workload(workload, config, clock="steps", progress=progress)) == \
            schedule_of(simulate(workload, config, model, clock="steps"))
        rows.append({
            "workload": name, "requests": len(workload),
            "steps_real": real.num_steps, "steps_sim": sim.num_steps,
            "ttft_err_median": float(np.median(ttft)), "e2e_err_median": float(np.median(e2e)),
            "ttft_p50_real_s": float(real.requests["ttft_s"].median()),
            "ttft_p50_sim_s": float(sim.requests["ttft_s"].median()),
            "e2e_p50_real_s": float(real.requests["e2e_s"].median()),
            "e2e_p50_sim_s": float(sim.requests["e2e_s"].median()),
            "schedule_identical": same,
        })
    return AccuracyReport(pd.DataFrame(rows).set_index("workload"))
