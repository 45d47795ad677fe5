"""capacity(): the highest arrival rate at which a configuration meets its latency SLOs.

An SLO is a mapping of :meth:`RunResult.summary` metrics to bounds, e.g. ``{"ttft_s_p99": 0.5,
"tpot_s_p99": 0.05}``; it holds at a rate when every request finished and every metric is at
most its bound. The workload is replayed with its arrivals rescaled to each rate tried
(:meth:`Workload.at_rate`: same requests, same order, gaps scaled), on its own clock.

The search: from the workload's own rate, the rate is doubled until the SLO breaks (or halved
until it holds), at most ``max_doublings`` times -- the bracket; then each round tries
``points`` rates evenly spaced inside the bracket (``points=1``: bisection) and keeps the
sub-bracket where it changes from holding to breaking, until ``high / low - 1 <= rel_tol``.
This assumes the metrics grow with the rate, as a queue's do; on real runs, noise near the
edge can move the answer by more than the tolerance. A round's rates run in parallel on
``executor`` (any ``concurrent.futures.Executor``: a process pool, a Dask
``client.get_executor()``); each task sends back its run's summary row, never its history.
The result is the same for any executor at the same ``points``.
"""

from __future__ import annotations

import concurrent.futures
import html
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from workbench.config import EngineConfig
from workbench.lab.run import resolve_config
from workbench.lab.runners import Runner, check_executor, resolve_runner
from workbench.lab.workload import Workload
from workbench.utils.errors import describe


def check_slo(slo: Mapping[str, float]) -> dict[str, float]:
    """``slo`` as a dict; ValueError naming a metric RunResult.summary() lacks or a bad bound."""
    from workbench.engine.replay import LATENCY_METRICS, PERCENTILES

    known = [f"{m}_p{p}" for m in LATENCY_METRICS for p in PERCENTILES]
    if not isinstance(slo, Mapping) or not slo:
        raise ValueError(f"slo must be a non-empty dict of metric -> bound, e.g. {{'ttft_s_p99': 0.5}}; got {slo!r}.")
    for key, bound in slo.items():
        if key not in known:
            raise ValueError(f"slo: unknown metric {key!r}; known: {known}.")
        if not (isinstance(bound, (int, float)) and bound > 0 and math.isfinite(bound)):
            raise ValueError(f"slo[{key!r}] must be a finite number > 0, got {bound!r}.")
    return {k: float(v) for k, v in slo.items()}


def slo_holds(summary: Mapping[str, float] | None, slo: Mapping[str, float]) -> bool:
    """Every request finished and every SLO metric is at most its bound (NaN breaks it)."""
    if not summary or summary.get("num_finished") != summary.get("num_requests"):
        return False
    return all(summary.get(k, math.nan) <= bound for k, bound in slo.items())


def evaluate_rate(run: str | Runner, workload: Workload, config: EngineConfig, rate: float) -> tuple[dict | None, str | None]:
    """One try, in a worker: the summary row of ``workload`` at ``rate`` (or the error as text)."""
    try:
        return dict(resolve_runner(run)(workload.at_rate(rate), config).summary()), None
    except Exception as e:
        return None, describe(e)


@dataclass
class Capacity:
    """The answer of :func:`capacity`: ``rate`` (requests per unit of the workload's clock;
    NaN when the SLO breaks at every rate tried), ``bounded`` (False when the SLO still held at
    the highest rate tried: ``rate`` is then a lower bound), ``table`` (one row per rate
    tried: the SLO metrics, whether it held, finished requests, throughput) and, after
    :meth:`confirm`, ``confirmation``."""

    rate: float
    slo: dict[str, float]
    table: object  # pandas DataFrame
    bounded: bool
    run: object
    config: EngineConfig
    workload: Workload
    confirmation: object = field(default=None, repr=False)

    def figure(self, *, figsize=None):
        """A matplotlib Figure (not pyplot's): each SLO metric against the rate, its bound, the
        rates that held (o) and broke (x), and the capacity found."""
        from matplotlib.figure import Figure

        n = len(self.slo)
        fig = Figure(figsize=figsize or (4.2 * n, 3.2), layout="constrained")
        t = self.table
        for i, (metric, bound) in enumerate(self.slo.items()):
            ax = fig.add_subplot(1, n, i + 1)
            ax.plot(t["rate"], t[metric], color="0.6", lw=1, zorder=1)
            ok = t["holds"].astype(bool)
            ax.scatter(t["rate"][ok], t[metric][ok], marker="o", color="tab:green", label="holds", zorder=2)
            ax.scatter(t["rate"][~ok], t[metric][~ok], marker="x", color="tab:red", label="breaks", zorder=2)
            ax.axhline(bound, color="tab:red", ls="--", lw=1, label=f"SLO {bound:g}")
            if math.isfinite(self.rate):
                ax.axvline(self.rate, color="tab:green", ls=":", lw=1.5, label=f"capacity {self.rate:.3g}")
            ax.set_xlabel(f"arrival rate (requests per {'s' if self.workload.clock == 'wall' else 'step'})")
            ax.set_ylabel(metric)
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
        fig.suptitle(f"capacity under the SLO ({run_name(self.run)} runs)")
        return fig

    def confirm(self, run: str | Runner = "real", factor: float = 1.25, *, cost_model=None):
        """Run ``workload`` at the capacity found and at ``factor`` times it with ``run``
        (default the real engine) and the search's own run, and return them side by side (a
        DataFrame, also kept as ``confirmation``): per rate, each SLO metric of both runs and
        whether the SLO held. Expected: it holds at the capacity and breaks at ``factor`` x.
        When ``run`` is real, ``real_steps_over_model`` is the median real / predicted step
        time (the shipped cost model, or ``cost_model``): far from 1, this machine is not the
        one the simulation describes (see :func:`workbench.lab.sim.probe_machine`)."""
        import pandas as pd

        from workbench.lab.sim.accuracy import step_ratio
        from workbench.lab.sim.cost_model import as_cost_model

        if not math.isfinite(self.rate):
            raise ValueError("confirm: the SLO broke at every rate tried; there is no capacity to confirm.")
        if not (factor > 1 and math.isfinite(factor)):
            raise ValueError(f"factor must be a finite number > 1, got {factor!r}.")
        rows = []
        for label, rate in (("capacity", self.rate), (f"{factor:g} x capacity", self.rate * factor)):
            wl = self.workload.at_rate(rate)
            row = {"point": label, "rate": rate}
            runners = {run_name(self.run): self.run, run_name(run): run}
            for name, runner in runners.items():
                result = resolve_runner(runner)(wl, self.config)
                s = result.summary()
                row.update({f"{m} ({name})": s[m] for m in self.slo})
                row[f"holds ({name})"] = slo_holds(s, self.slo)
                if runner == "real":
                    row["real_steps_over_model"] = step_ratio(as_cost_model(cost_model), [result])
            rows.append(row)
        self.confirmation = pd.DataFrame(rows).set_index("point")
        return self.confirmation

    def __repr__(self) -> str:
        slo = ", ".join(f"{k} <= {v:g}" for k, v in self.slo.items())
        bound = "" if self.bounded else " (still held at the highest rate tried: a lower bound)"
        return (f"Capacity({self.rate:.4g} requests/{'s' if self.workload.clock == 'wall' else 'step'}{bound} "
                f"under {slo}; {len(self.table)} rates tried, {run_name(self.run)} runs)")

    def _repr_html_(self) -> str:
        return (f"<div><b>{html.escape(repr(self))}</b>"
                + self.table.to_html(float_format=lambda v: f"{v:.4g}", index=False) + "</div>")


def capacity(
    workload: Workload,
    config: EngineConfig | dict | None = None,
    slo: Mapping[str, float] | None = None,
    *,
    run: str | Runner = "sim",
    base: EngineConfig | None = None,
    rel_tol: float = 0.05,
    points: int = 1,
    max_doublings: int = 8,
    executor: concurrent.futures.Executor | None = None,
    confirm: bool = False,
    progress: bool = True,
) -> Capacity:
    """The highest rate at which ``workload`` (arrivals rescaled) on ``config`` meets every
    SLO (see the module docstring). ``run``: ``"sim"`` (default), ``"real"`` or a picklable
    callable (:mod:`workbench.lab.runners`). ``confirm=True``: then :meth:`Capacity.confirm`
    with the real engine. ``progress``: a tqdm bar over the rates tried."""
    import pandas as pd
    from tqdm.auto import tqdm

    if not isinstance(workload, Workload):
        raise ValueError(f"workload must be a Workload, got {type(workload).__name__}.")
    slo = check_slo(slo)
    start = workload.rate
    if not math.isfinite(start):
        raise ValueError("capacity: every request of the workload arrives at once; give it arrival times to rescale.")
    if not (0 < rel_tol < 1):
        raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol!r}.")
    for name, value, low in (("points", points, 1), ("max_doublings", max_doublings, 1)):
        if not (isinstance(value, int) and value >= low):
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
    resolve_runner(run)
    check_executor(run, executor)
    resolved = resolve_config(config, base)
    tried: dict[float, tuple[dict | None, str | None]] = {}
    bar = tqdm(desc="capacity", unit="rate", disable=not progress)

    def holds(rates: list[float]) -> list[bool]:
        new = [r for r in rates if r not in tried]
        if executor is None:
            for r in new:
                tried[r] = evaluate_rate(run, workload, resolved, r)
        else:
            futures = {executor.submit(evaluate_rate, run, workload, resolved, r): r for r in new}
            for future in concurrent.futures.as_completed(futures):
                try:
                    tried[futures[future]] = future.result()
                except Exception as e:  # the executor's own failure
                    tried[futures[future]] = (None, describe(e))
        bar.update(len(new))
        return [slo_holds(tried[r][0], slo) for r in rates]

    with bar:
        low = high = None
        if holds([start])[0]:
            low = start
            for _ in range(max_doublings):
                r = low * 2
                if not holds([r])[0]:
                    high = r
                    break
                low = r
        else:
            high = start
            for _ in range(max_doublings):
                r = high / 2
                if holds([r])[0]:
                    low = r
                    break
                high = r
        while low is not None and high is not None and high / low - 1 > rel_tol:
            bar.set_postfix_str(f"{low:.4g}..{high:.4g}")
            inner = [low + (high - low) * (k + 1) / (points + 1) for k in range(points)]
            ok = holds(inner)
            edges = [low, *inner, high]
            marks = [True, *ok, False]
            k = max(i for i, m in enumerate(marks[:-1]) if m)  # the last rate that held
            low, high = edges[k], edges[k + 1]
    rows = []
    for r in sorted(tried):
        summary, error = tried[r]
        s = summary or {}
        rows.append({"rate": r, **{m: s.get(m, math.nan) for m in slo}, "holds": slo_holds(summary, slo),
                     "num_finished": s.get("num_finished", math.nan),
                     "throughput_tok_s": s.get("throughput_tok_s", math.nan), "error": error})
    result = Capacity(rate=low if low is not None else math.nan, slo=slo, table=pd.DataFrame(rows),
                      bounded=high is not None, run=run, config=resolved, workload=workload)
    if confirm:
        result.confirm()
    return result


def capacity_row(run: str | Runner, workload: Workload, config: EngineConfig, slo: Mapping[str, float],
                 **search) -> dict:
    """One configuration's capacity as a summary row (what a sweep worker sends back):
    ``capacity_rate``, ``capacity_bounded``, ``rates_tried`` and the SLO metrics at that rate."""
    found = capacity(workload, config, slo, run=run, progress=False, **search)
    at = found.table[found.table["rate"] == found.rate]
    return {"capacity_rate": found.rate, "capacity_bounded": found.bounded, "rates_tried": len(found.table),
            **{f"{m}_at_capacity": (float(at[m].iloc[0]) if len(at) else math.nan) for m in found.slo}}


def run_name(run) -> str:
    """A run's label in tables: its name, or its function's (``functools.partial`` unwrapped)."""
    if isinstance(run, str):
        return run
    return getattr(getattr(run, "func", run), "__name__", type(run).__name__)
