"""capacity(): the highest arrival rate at which a configuration meets its latency SLOs.

An SLO is a mapping of :meth:`RunResult.summary` metrics to bounds, e.g. ``{"ttft_s_p99": 0.5,
"tpot_s_p99": 0.05}``; it holds at a rate when every request finished and every metric is at
most its bound. The workload is replayed with its arrivals rescaled to each rate tried
(:meth:`Workload.at_rate`: same requests, same order, gaps scaled), on its own clock.

The search asks for ``headroom`` besides (default 10%): every metric at most
``(1 - headroom) x`` its bound. A p99 of one run of a few hundred requests is a noisy figure
(three real runs of one workload at one rate on the project's 2-core VM: 0.88-0.98 s where the
simulation said 0.91 s, 1.01-1.17 s where it said 0.99 s), so a rate found exactly at the edge
holds or breaks on the next run by chance; with headroom a real run there holds unless it
comes out more than that fraction slower. ``headroom=0`` finds the edge itself.

The search: from the workload's own rate, the rate is doubled until the SLO breaks (or halved
until it holds), at most ``max_doublings`` times -- the bracket; then each round tries
``points`` rates evenly spaced inside the bracket (``points=1``: bisection) and keeps the
sub-bracket where it changes from holding to breaking, until ``high / low - 1 <= rel_tol``.
This assumes the metrics grow with the rate, as a queue's do; on real runs, noise near the
edge can move the answer by more than the tolerance. A finite workload drains in finite time:
when even its densest replay meets the SLO, no rate breaks it (``bounded`` is False) -- more
requests let a queue build. A round's rates run in parallel on ``executor`` (any
``concurrent.futures.Executor``: a process pool, a Dask ``client.get_executor()``); each task
sends back its run's summary row, never its history.
The result is the same for any executor at the same ``points``.

Simulated seconds are the cost model's: on another machine, or this one under other load, the
simulated capacity is off by the machine's pace. ``recalibrate=N`` checks the answer on the
real engine, up to N times: one real run at the capacity found, the cost model rescaled to its
measured steps (:meth:`CostModel.rescaled_to`: one factor for prefill costs, one for the rest
-- the machine's pace at that very load), and, when a factor is more than 5% off 1, the search
made again on the rescaled model. The rounds are kept as ``recalibrations``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import html
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from workbench.config import EngineConfig
from workbench.lab.run import resolve_config, run_real
from workbench.lab.runners import Runner, check_executor, resolve_runner
from workbench.lab.sim.accuracy import MACHINE_DRIFT, step_ratio
from workbench.lab.sim.cost_model import CostModel, as_cost_model
from workbench.lab.sim.simulate import simulate
from workbench.lab.workload import Workload
from workbench.utils.errors import describe


def check_slo(slo: Mapping[str, float]) -> dict[str, float]:
    """``slo`` as a dict; ValueError naming a metric RunResult.summary() lacks or a bad bound."""
    from workbench.lab.replay import LATENCY_METRICS, PERCENTILES

    known = [f"{m}_p{p}" for m in LATENCY_METRICS for p in PERCENTILES]
    if not isinstance(slo, Mapping) or not slo:
        raise ValueError(f"slo must be a non-empty dict of metric -> bound, e.g. {{'ttft_s_p99': 0.5}}; got {slo!r}.")
    for key, bound in slo.items():
        if key not in known:
            raise ValueError(f"slo: unknown metric {key!r}; known: {known}.")
        if not (isinstance(bound, (int, float)) and bound > 0 and math.isfinite(bound)):
            raise ValueError(f"slo[{key!r}] must be a finite number > 0, got {bound!r}.")
    return {k: float(v) for k, v in slo.items()}


def with_headroom(slo: Mapping[str, float], headroom: float) -> dict[str, float]:
    """Each bound of ``slo`` times ``1 - headroom``."""
    return {k: v * (1.0 - headroom) for k, v in slo.items()}


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
    tried: the SLO metrics, whether they held with the headroom, finished requests,
    throughput), ``cost_model`` (the simulator's, after any recalibration; None for other
    runs), ``recalibrations`` (one row per real check of ``recalibrate``: see
    :func:`real_check`; None without) and, after :meth:`confirm`, ``confirmation``."""

    rate: float
    slo: dict[str, float]
    headroom: float
    table: object  # pandas DataFrame
    bounded: bool
    run: object
    config: EngineConfig
    workload: Workload
    cost_model: CostModel | None = field(default=None, repr=False)
    recalibrations: object = field(default=None, repr=False)  # pandas DataFrame
    confirmation: object = field(default=None, repr=False)

    @property
    def target(self) -> dict[str, float]:
        """The bounds the search held the metrics to: each SLO bound times (1 - headroom)."""
        return with_headroom(self.slo, self.headroom)

    @property
    def runner(self) -> Runner:
        """The callable the search ran: the simulator on ``cost_model`` when ``run`` is "sim"."""
        return search_runner(self.run, self.cost_model)

    def figure(self, *, figsize=None):
        """A matplotlib Figure (not pyplot's): each SLO metric against the rate, its bound (and
        the headroom's), the rates where every SLO held (o) or one broke (x) -- in each panel,
        whichever metric broke -- and the capacity found."""
        from matplotlib.figure import Figure

        n = len(self.slo)
        fig = Figure(figsize=figsize or (4.2 * n, 3.2), layout="constrained")
        t = self.table
        for i, (metric, bound) in enumerate(self.slo.items()):
            ax = fig.add_subplot(1, n, i + 1)
            ax.plot(t["rate"], t[metric], color="0.6", lw=1, zorder=1)
            ok = t["holds"].astype(bool)
            ax.scatter(t["rate"][ok], t[metric][ok], marker="o", color="tab:green", label="every SLO holds", zorder=2)
            ax.scatter(t["rate"][~ok], t[metric][~ok], marker="x", color="tab:red", label="an SLO breaks", zorder=2)
            ax.axhline(bound, color="tab:red", ls="--", lw=1, label=f"SLO {bound:g}")
            if self.headroom:
                ax.axhline(self.target[metric], color="tab:orange", ls=":", lw=1,
                           label=f"searched at {self.target[metric]:.3g} ({self.headroom:.0%} headroom)")
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
        time (the search's cost model, or ``cost_model``): far from 1, this machine is not the
        one the simulation describes (see :func:`workbench.lab.sim.probe_machine`)."""
        import pandas as pd

        if not math.isfinite(self.rate):
            raise ValueError("confirm: the SLO broke at every rate tried; there is no capacity to confirm.")
        if not (factor > 1 and math.isfinite(factor)):
            raise ValueError(f"factor must be a finite number > 1, got {factor!r}.")
        rows = []
        for label, rate in (("capacity", self.rate), (f"{factor:g} x capacity", self.rate * factor)):
            wl = self.workload.at_rate(rate)
            row = {"point": label, "rate": rate}
            runners = {run_name(self.run): self.runner, run_name(run): resolve_runner(run)}
            for name, runner in runners.items():
                result = runner(wl, self.config)
                s = result.summary()
                row.update({f"{m} ({name})": s[m] for m in self.slo})
                row[f"holds ({name})"] = slo_holds(s, self.slo)
                if runner is run_real:
                    model = self.cost_model if cost_model is None else as_cost_model(cost_model)
                    row["real_steps_over_model"] = step_ratio(model or as_cost_model(None), [result])
            rows.append(row)
        self.confirmation = pd.DataFrame(rows).set_index("point")
        return self.confirmation

    def __repr__(self) -> str:
        slo = ", ".join(f"{k} <= {v:g}" for k, v in self.slo.items())
        if self.headroom:
            slo += f" with {self.headroom:.0%} headroom"
        bound = "" if self.bounded else (" (still held at the highest rate tried: a lower bound; more requests "
                                         "would let a queue build)")
        recal = ""
        if self.recalibrations is not None and len(self.recalibrations):
            factors = ", ".join(f"prefill x{r.prefill_x:.3g} rest x{r.other_x:.3g}"
                                for r in self.recalibrations.itertuples() if r.rescaled)
            recal = f", {len(self.recalibrations)} real check(s)" + (f", rescaled: {factors}" if factors else "")
        return (f"Capacity({self.rate:.4g} requests/{'s' if self.workload.clock == 'wall' else 'step'}{bound} "
                f"under {slo}; {len(self.table)} rates tried, {run_name(self.run)} runs{recal})")

    def _repr_html_(self) -> str:
        fmt = lambda v: f"{v:.4g}"  # noqa: E731
        recal = ("" if self.recalibrations is None else
                 "<p>recalibrations</p>" + self.recalibrations.to_html(float_format=fmt, index=False))
        return (f"<div><b>{html.escape(repr(self))}</b>"
                + self.table.to_html(float_format=fmt, index=False) + recal + "</div>")


def capacity(
    workload: Workload,
    config: EngineConfig | dict | None = None,
    slo: Mapping[str, float] | None = None,
    *,
    run: str | Runner = "sim",
    cost_model: CostModel | str | None = None,
    recalibrate: int = 0,
    headroom: float = 0.1,
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
    callable (:mod:`workbench.lab.runners`). ``cost_model`` (a CostModel or its JSON; default
    the shipped one) and ``recalibrate`` (real checks, default 0) go with ``run="sim"``.
    ``headroom``: the fraction below each bound the search keeps the metrics (module docstring).
    ``confirm=True``: then :meth:`Capacity.confirm` with the real engine. ``progress``: a tqdm
    bar over the rates tried."""
    import pandas as pd
    from tqdm.auto import tqdm

    if not isinstance(workload, Workload):
        raise ValueError(f"workload must be a Workload, got {type(workload).__name__}.")
    slo = check_slo(slo)
    if not math.isfinite(workload.rate):
        raise ValueError("capacity: every request of the workload arrives at once; give it arrival times to rescale.")
    if not (0 < rel_tol < 1):
        raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol!r}.")
    if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
        raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom!r}.")
    target = with_headroom(slo, headroom)
    for name, value, low in (("points", points, 1), ("max_doublings", max_doublings, 1), ("recalibrate", recalibrate, 0)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
    if run != "sim" and (cost_model is not None or recalibrate):
        raise ValueError(f"cost_model and recalibrate are the simulator's: they go with run='sim', not {run!r}.")
    resolve_runner(run)
    check_executor(run, executor)
    resolved = resolve_config(config, base)
    model = as_cost_model(cost_model) if run == "sim" else None
    bar = tqdm(desc="capacity", unit="rate", disable=not progress)
    rounds = []
    with bar:
        while True:
            low, high, tried = _search(search_runner(run, model), workload, resolved, target, rel_tol=rel_tol,
                                       points=points, max_doublings=max_doublings, executor=executor, bar=bar)
            if len(rounds) == recalibrate or low is None:
                break
            bar.set_postfix_str(f"real run at {low:.4g}")
            check, rescaled = real_check(workload.at_rate(low), resolved, slo, model)
            rounds.append({"rate": low, **check})
            if not check["rescaled"]:
                break
            model = rescaled
    rows = []
    for r in sorted(tried):
        summary, error = tried[r]
        s = summary or {}
        rows.append({"rate": r, **{m: s.get(m, math.nan) for m in slo}, "holds": slo_holds(summary, target),
                     "num_finished": s.get("num_finished", math.nan),
                     "throughput_tok_s": s.get("throughput_tok_s", math.nan), "error": error})
    result = Capacity(rate=low if low is not None else math.nan, slo=slo, headroom=float(headroom),
                      table=pd.DataFrame(rows), bounded=high is not None, run=run, config=resolved,
                      workload=workload, cost_model=model,
                      recalibrations=pd.DataFrame(rounds) if recalibrate else None)
    if confirm:
        result.confirm()
    return result


def real_check(workload: Workload, config: EngineConfig, slo: dict[str, float],
               model: CostModel) -> tuple[dict, CostModel]:
    """One real run of ``workload``: its SLO metrics and verdict, its median measured /
    predicted step (``real_steps_over_model``), the two factors of ``model.rescaled_to`` it
    (``prefill_x``, ``other_x``), whether either is more than 5% off 1 (``rescaled``), and that
    rescaled model."""
    real = run_real(workload, config)
    s = real.summary()
    rescaled = model.rescaled_to(real)
    factors = {"prefill_x": rescaled.fit_stats["rescale_prefill"], "other_x": rescaled.fit_stats["rescale_other"]}
    return {**{f"{m} (real)": s[m] for m in slo}, "holds (real)": slo_holds(s, slo),
            "real_steps_over_model": step_ratio(model, [real]), **factors,
            "rescaled": any(abs(f - 1.0) > MACHINE_DRIFT for f in factors.values())}, rescaled


def _search(runner: Runner, workload: Workload, config: EngineConfig, slo: dict[str, float], *, rel_tol: float,
            points: int, max_doublings: int, executor, bar) -> tuple[float | None, float | None, dict]:
    """The bracket, then the rounds inside it (the module docstring): ``(low, high, tried)``
    with ``low`` the last rate that held (None: none did), ``high`` the first that broke
    (None: none did) and ``tried`` rate -> (summary row, error)."""
    tried: dict[float, tuple[dict | None, str | None]] = {}

    def holds(rates: list[float]) -> list[bool]:
        new = [r for r in rates if r not in tried]
        if executor is None:
            for r in new:
                tried[r] = evaluate_rate(runner, workload, config, r)
        else:
            futures = {executor.submit(evaluate_rate, runner, workload, config, r): r for r in new}
            for future in concurrent.futures.as_completed(futures):
                try:
                    tried[futures[future]] = future.result()
                except Exception as e:  # the executor's own failure
                    tried[futures[future]] = (None, describe(e))
        bar.update(len(new))
        return [slo_holds(tried[r][0], slo) for r in rates]

    low = high = None
    if holds([workload.rate])[0]:
        low = workload.rate
        for _ in range(max_doublings):
            r = low * 2
            if not holds([r])[0]:
                high = r
                break
            low = r
    else:
        high = workload.rate
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
    return low, high, tried


def search_runner(run: str | Runner, cost_model: CostModel | None) -> Runner:
    """What a search with ``run`` calls: the simulator on ``cost_model`` (picklable, for
    executors) when ``run`` is "sim" and a model is given, else :func:`resolve_runner`'s."""
    if run == "sim" and cost_model is not None:
        return functools.partial(simulate, cost_model=cost_model)
    return resolve_runner(run)


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
