"""accuracy(): simulated vs real runs of the same workloads, request by request.

For each workload (default: Poisson arrivals at two rates per second, mixed prompt and output
lengths, groups of requests sharing a prefix -- none of it what calibration ran) it runs the
real engine and the simulation with the same config, on both clocks: the workload's numbers
are read as seconds and as steps (:meth:`~workbench.lab.workload.Workload.on_clock`), so each
request needs both arrival fields, as a generated one has:

* ``clock="wall"``: per-request TTFT and e2e latency. A real run on this kind of machine is
  itself noisy (two runs of one workload differ by 2-10% per request on the project's 2-vCPU
  VM), so the real latency of a request is its median over ``repeats`` real runs; the error
  of a request is ``|simulated - real| / real``; the table gives the median over requests
  (target <= 5%), its signed median (the bias: < 0 when the simulation is fast), and the
  floor: the same median error between two single real runs (median over pairs);
* ``clock="steps"``: whether the step-by-step schedule (which request ran in which step,
  how many tokens, prefill or decode) is identical;
* ``step_real_over_model``: the median, over the real runs' measured steps, of measured /
  predicted duration. It tells a model that is wrong from a machine that changed speed: near
  1.00 the steps ran as the cost model says and the error is the model's (or the queueing it
  drives); at 1.10 the real engine ran 10% slower than when it was calibrated (another
  process, a noisy neighbour on a VM, another thread count), which no cost model predicts.
  The report adds a line for each workload where it is more than 5% off 1.

With ``speculative_config`` the simulation draws acceptance from a profile measured on the
real runs of the same workload (or the ``spec_profile`` given); its schedule then differs from
the real one by those draws, so ``schedule_identical`` is None (not compared).

The real engine first runs the workload once untimed (then its prefix cache is emptied): a
process's first passes over new shapes pay one-time costs (allocations, page faults) that no
step model describes. Real wall-clock figures move with the machine's load: run it on a
quiet machine.

Beside each error, its verdict and two answers to a machine whose pace moved:

* ``*_within_floor``: the error is at most the real-vs-real floor -- the simulation is as close
  to a real run as a second real run is; :attr:`AccuracyReport.good` when every one is (and
  every schedule identical);
* a prediction band: the workload simulated again with every time scaled by the calibration's
  10th and 90th percentile of measured / predicted step time (:func:`band_factors`; a model
  without them: 1 -/+ its p90 absolute error), and ``e2e_in_band``, the fraction of requests
  whose real e2e lies inside;
* a recalibration from the workload's own first (untimed) real run -- the machine's pace now:
  that run's median measured / predicted step (``recal_factor``), the model rescaled to its
  steps (:meth:`~workbench.lab.sim.cost_model.CostModel.rescaled_to`: prefill costs times
  ``recal_prefill_x``, the rest times ``recal_other_x``), and the rescaled model's errors
  ``*_err_recal`` with their verdicts ``*_recal_within_floor``.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import numpy as np

from workbench.config import EngineConfig
from workbench.engine.llm_engine import LLMEngine
from workbench.lab.replay import replay_workload
from workbench.lab.run import resolve_config, run_real
from workbench.lab.sim.cost_model import as_cost_model
from workbench.lab.sim.measurements import measured_steps, records_of
from workbench.lab.sim.simulate import simulate
from workbench.lab.sim.spec_decode import SpecDecodeProfile
from workbench.lab.workload import Workload


def default_workloads(num_requests: int = 40, rates: tuple[float, ...] = (4.0, 12.0)) -> dict[str, Workload]:
    """Poisson workloads at ``rates`` (requests/s): prompts 24..400 tokens, outputs 4..96,
    four 32-token shared prefixes; seeds other than calibration's."""
    return {
        f"poisson {rate:g}/s": Workload.poisson(num_requests, rate=rate, input_len=(40, 400), output_len=(4, 96),
                                                num_prefix_groups=4, prefix_len=32, seed=100 + i, clock="wall")
        for i, rate in enumerate(rates)
    }


def schedule_of(result) -> list[tuple[tuple[str, int, bool], ...]]:
    """Per step: (request id, tokens, prefill?) of every scheduled chunk."""
    return [tuple((s.request_id, s.num_new_tokens, s.is_prefill) for s in r.scheduler_output.scheduled)
            for r in result.history]


def latency_errors(real, simulated, metric: str) -> np.ndarray:
    """``|sim - real| / real`` of ``metric`` per request both runs finished (request order)."""
    return np.abs(signed_errors(real, simulated, metric))


def signed_errors(real, simulated, metric: str) -> np.ndarray:
    """``(sim - real) / real`` of ``metric`` per request both finished; ``real`` may be a
    RunResult or a Series of per-request values indexed by request id."""
    import pandas as pd

    a = real if isinstance(real, pd.Series) else real.requests.set_index("request_id")[metric]
    a = a.astype("float64")
    b = simulated.requests.set_index("request_id")[metric].astype("float64").reindex(a.index)
    ok = a.notna() & b.notna() & (a > 0)
    return ((b[ok] - a[ok]) / a[ok]).to_numpy()


def step_ratio(model, runs) -> float:
    """Median of measured / predicted duration over the non-empty measured steps of ``runs``
    (RunResults or histories of real runs; see :mod:`workbench.lab.sim.measurements`)."""
    ratios = []
    for run in runs:
        x, y, empty = measured_steps(records_of(run))
        ratios.append(y[~empty] / model.predict_many(x[~empty]))
    return float(np.median(np.concatenate(ratios)))


def median_of_runs(runs, metric: str):
    """Per request id, the median of ``metric`` over ``runs`` (RunResults)."""
    import pandas as pd

    frame = pd.concat([r.requests.set_index("request_id")[metric].astype("float64") for r in runs], axis=1)
    return frame.median(axis=1)


#: ``step_real_over_model`` further than this from 1 means the machine changed speed.
MACHINE_DRIFT = 0.05


def band_factors(model) -> tuple[float, float]:
    """(low, high) time factors of the prediction band: the calibration's 10th and 90th
    percentile of measured / predicted step time (``fit_stats["ratio_p10"]``, ``["ratio_p90"]``),
    or ``1 -/+ fit_stats["p90_abs_rel_err"]`` for a model fitted before they were recorded."""
    stats = model.fit_stats
    if "ratio_p10" in stats and "ratio_p90" in stats:
        return float(stats["ratio_p10"]), float(stats["ratio_p90"])
    spread = float(stats.get("p90_abs_rel_err", 0.0))
    return max(1e-3, 1.0 - spread), 1.0 + spread


def fraction_in_band(real, low, high, metric: str) -> float:
    """The fraction of requests (``real``: per-request values by id) whose value lies in
    ``[low, high]`` of the two band simulations."""
    lo = low.requests.set_index("request_id")[metric].astype("float64").reindex(real.index)
    hi = high.requests.set_index("request_id")[metric].astype("float64").reindex(real.index)
    ok = real.notna() & lo.notna() & hi.notna()
    inside = (real[ok] >= lo[ok]) & (real[ok] <= hi[ok])
    return float(inside.mean()) if ok.any() else float("nan")


@dataclass
class AccuracyReport:
    """One row per workload: median absolute relative errors of TTFT and e2e (clock="wall"),
    their signed medians (bias) and the real-vs-real floor, p50s real and simulated, whether
    the clock="steps" schedules are identical, and how fast the real steps ran against the
    cost model (``step_real_over_model``)."""

    table: object  # pandas DataFrame

    @property
    def ok(self) -> bool:
        """Every workload within 5% on both metrics, every schedule identical."""
        t = self.table
        schedules = t["schedule_identical"]
        return bool((t["ttft_err_median"] <= 0.05).all() and (t["e2e_err_median"] <= 0.05).all()
                    and all(same is None or same for same in schedules))

    @property
    def good(self) -> bool:
        """Every error within its real-vs-real floor (as close to a real run as a second real
        run is), every schedule identical."""
        t = self.table
        return bool(t["ttft_within_floor"].all() and t["e2e_within_floor"].all() and t["schedule_identical"].all())

    def machine_notes(self) -> list[str]:
        """One line per workload whose real steps ran more than 5% off the cost model
        (``step_real_over_model``): there the machine, not the model, moved."""
        notes = []
        for name, ratio in self.table["step_real_over_model"].items():
            if abs(ratio - 1.0) > MACHINE_DRIFT:
                pace = "slower" if ratio > 1 else "faster"
                notes.append(f"{name}: the real steps took {ratio:.2f}x the cost model's time (median): this machine "
                             f"ran {abs(ratio - 1):.0%} {pace} than the model describes (other load, another thread "
                             "count, a model calibrated elsewhere), and the latency errors carry that.")
        return notes

    def __repr__(self) -> str:
        return "\n".join(["AccuracyReport", self.table.T.to_string(float_format=lambda v: f"{v:.4g}"),
                          *self.machine_notes()])

    def _repr_html_(self) -> str:
        notes = "".join(f"<p>{html.escape(line)}</p>" for line in self.machine_notes())
        verdict = (f"within 5% and identical schedules: {self.ok}; within the real-vs-real floor "
                   f"(good): {self.good}")
        return ("<b>AccuracyReport</b>" + self.table.to_html(float_format=lambda v: f"{v:.4g}")
                + f"<p>{html.escape(verdict)}</p>" + notes)


def accuracy(cost_model=None, config: EngineConfig | dict | None = None, *,
             workloads: dict[str, Workload] | None = None, repeats: int = 3,
             progress: bool = False, spec_profile=None) -> AccuracyReport:
    """Run each workload real (``repeats`` times, after one untimed run) and simulated (both
    clocks); see the module docstring. Warns when the cost model was calibrated with another
    number of CPU threads than this process uses."""
    import itertools
    import warnings

    import pandas as pd
    import torch

    if not (isinstance(repeats, int) and repeats >= 1):
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}.")
    model = as_cost_model(cost_model)
    threads = model.hardware.get("threads")
    if model.hardware.get("device") == "cpu" and threads and threads != torch.get_num_threads():
        warnings.warn(f"the cost model was calibrated with {threads} torch threads, this process uses "
                      f"{torch.get_num_threads()}: the real runs are not the engine it describes "
                      "(torch.set_num_threads, or `--threads`).", stacklevel=2)
    rows = []
    for name, workload in (workloads or default_workloads()).items():
        timed, stepped = workload.on_clock("wall"), workload.on_clock("steps")
        engine = LLMEngine(resolve_config(config))
        runs = []
        for i in range(repeats + 1):
            run = replay_workload(engine, timed, progress=progress)
            engine.reset_prefix_cache()
            if i:  # the first run warms the process up
                runs.append(run)
            else:  # the machine's pace now, from the workload itself
                recal, rescaled = step_ratio(model, [run]), model.rescaled_to(run)
        speculative = resolve_config(config).speculative_config is not None
        profile = (spec_profile or SpecDecodeProfile.from_run(runs)) if speculative else None
        sim = simulate(timed, config, model, spec_profile=profile)
        low, high = band_factors(model)
        band = [simulate(timed, config, model.scaled(f), spec_profile=profile) for f in (low, high)]
        recal_sim = simulate(timed, config, rescaled, spec_profile=profile)
        reference = {m: median_of_runs(runs, m) for m in ("ttft_s", "e2e_s")}
        ttft, e2e = (signed_errors(reference[m], sim, m) for m in ("ttft_s", "e2e_s"))
        pairs = list(itertools.combinations(runs, 2))
        floor = {m: float(np.median([np.median(latency_errors(a, b, m)) for a, b in pairs])) if pairs else float("nan")
                 for m in ("ttft_s", "e2e_s")}
        same = None if speculative else schedule_of(run_real(stepped, config, progress=progress)) == \
            schedule_of(simulate(stepped, config, model))
        ttft_rc, e2e_rc = (float(np.median(latency_errors(reference[m], recal_sim, m))) for m in ("ttft_s", "e2e_s"))
        rows.append({
            "workload": name, "requests": len(workload), "real_runs": repeats,
            "steps_real": int(np.median([r.num_steps for r in runs])), "steps_sim": sim.num_steps,
            "ttft_err_median": float(np.median(np.abs(ttft))), "ttft_bias": float(np.median(ttft)),
            "ttft_floor": floor["ttft_s"],
            "e2e_err_median": float(np.median(np.abs(e2e))), "e2e_bias": float(np.median(e2e)),
            "e2e_floor": floor["e2e_s"],
            "ttft_within_floor": bool(np.median(np.abs(ttft)) <= floor["ttft_s"]),
            "e2e_within_floor": bool(np.median(np.abs(e2e)) <= floor["e2e_s"]),
            "band_low": low, "band_high": high,
            "e2e_in_band": fraction_in_band(reference["e2e_s"], band[0], band[1], "e2e_s"),
            "recal_factor": recal, "recal_prefill_x": rescaled.fit_stats["rescale_prefill"],
            "recal_other_x": rescaled.fit_stats["rescale_other"], "ttft_err_recal": ttft_rc, "e2e_err_recal": e2e_rc,
            "ttft_recal_within_floor": bool(ttft_rc <= floor["ttft_s"]),
            "e2e_recal_within_floor": bool(e2e_rc <= floor["e2e_s"]),
            "ttft_p50_real_s": float(reference["ttft_s"].median()),
            "ttft_p50_sim_s": float(sim.requests["ttft_s"].median()),
            "e2e_p50_real_s": float(reference["e2e_s"].median()),
            "e2e_p50_sim_s": float(sim.requests["e2e_s"].median()),
            "schedule_identical": same,
            "step_real_over_model": step_ratio(model, runs),
        })
    return AccuracyReport(pd.DataFrame(rows).set_index("workload"))
