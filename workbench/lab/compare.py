"""run_workload / compare_runs: a workload on fresh engines built from configurations.

``run_workload(workload, config)`` runs it on a real engine (:func:`workbench.lab.run.run_real`)
or, with ``simulate=True``, on a simulated one (:func:`workbench.lab.sim.simulate`);
``compare_runs`` does so once per named configuration and puts the runs side by side.

Every configuration runs the same :class:`~workbench.lab.workload.Workload` on a fresh engine
(same arrivals, prompts and output lengths), so differences in the table come from the
configuration: policy, token budget, chunked prefill, block size, pool size, prefix caching.
On the step clock (a workload's default) the step-based columns (``*_steps_*``, ``throughput_tok_step``,
preemptions, recomputed tokens) are exactly reproducible; the ``*_s`` ones are wall times.
``simulate=True`` runs the same scheduler with a simulated runner instead of the model
(:func:`workbench.lab.sim.simulate`: seconds predicted by ``cost_model``, no weights loaded).
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping

from workbench.config import EngineConfig
from workbench.lab.replay import RunResult
from workbench.lab.run import resolve_config, run_real
from workbench.lab.sim.simulate import simulate as run_simulated
from workbench.lab.workload import Workload

#: Column labels (with units) of the metrics a CDF can be drawn for.
METRIC_LABELS = {
    "ttft_s": "time to first token (s)",
    "tpot_s": "time per output token (s)",
    "e2e_s": "end-to-end latency (s)",
    "queue_s": "queue time (s)",
    "ttft_steps": "time to first token (steps)",
    "tpot_steps": "time per output token (steps)",
    "e2e_steps": "end-to-end latency (steps)",
}


def run_workload(
    workload: Workload,
    config: EngineConfig | dict | None = None,
    *,
    clock: str | None = None,
    progress: bool = False,
    simulate: bool = False,
    cost_model=None,
) -> RunResult:
    """Run ``workload`` on a fresh engine built from ``config`` (see :func:`resolve_config`)
    until every request finished, on the workload's clock (``clock``, when given, must be it:
    see :mod:`workbench.lab.workload`). ``simulate=True``: on a
    simulated runner with ``cost_model`` (a CostModel, its JSON path, None for the shipped
    CPU calibration); see :func:`workbench.lab.sim.simulate`."""
    if simulate:
        return run_simulated(workload, config, cost_model, clock=clock, progress=progress)
    if cost_model is not None:
        raise ValueError("cost_model is only used with simulate=True.")
    return run_real(workload, config, clock=clock, progress=progress)


class Comparison:
    """The runs of one workload under named configurations.

    ``results``: name -> :class:`RunResult`; ``table``: one row per configuration (the
    RunResult summaries); ``requests``: the per-request rows of every run;
    :meth:`cdf_figure`: per-request metric CDFs, one line per run.
    """

    def __init__(self, workload: Workload, results: Mapping[str, RunResult], *, fork_step: int | None = None):
        self.workload = workload
        self.results = dict(results)
        #: Branches of one run (:func:`compare_branches`): the step they forked at, else None.
        self.fork_step = fork_step

    @property
    def names(self) -> list[str]:
        return list(self.results)

    @property
    def table(self):
        """pandas DataFrame indexed by configuration name, one column per summary number."""
        import pandas as pd

        frame = pd.DataFrame({name: r.summary() for name, r in self.results.items()}).T
        frame.index.name = "config"
        return frame

    @property
    def requests(self):
        """Every run's requests DataFrame stacked, with the configuration name first
        (``config``): one row per (config, request), for side-by-side per-request analysis."""
        import pandas as pd

        frames = [r.requests.assign(config=name) for name, r in self.results.items()]
        frame = pd.concat(frames, ignore_index=True)
        return frame[["config", *[c for c in frame.columns if c != "config"]]]

    def per_request(self, metrics: tuple[str, ...] = ("ttft_steps", "e2e_steps")):
        """One row per request, one column per (metric, run): what each run cost each request."""
        frame = self.requests.pivot(index="request_id", columns="config", values=list(metrics))
        return frame.reindex(columns=[(m, name) for m in metrics for name in self.results])

    def cdf_figure(self, metric: str = "ttft_s", *, figsize=(6.0, 3.6)):
        """A matplotlib ``Figure`` (not registered with pyplot, so safe from any thread) with
        the empirical CDF of ``metric`` over the requests of each run."""
        if metric not in METRIC_LABELS:
            raise ValueError(f"metric must be one of {sorted(METRIC_LABELS)}, got {metric!r}.")
        from matplotlib.figure import Figure

        fig = Figure(figsize=figsize, layout="constrained")
        ax = fig.add_subplot()
        for name, result in self.results.items():
            values = sorted(v for v in result.requests[metric].astype("float64") if not math.isnan(v))
            if not values:
                continue
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, fractions, where="post", label=f"{name} ({len(values)})")
        ax.set_xlabel(METRIC_LABELS[metric])
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(f"CDF of {metric} over {len(self.workload)} requests")
        if self.results:
            ax.legend(title="config (requests)", fontsize="small")
        return fig

    def __repr__(self) -> str:
        rows = [f"  forked at step {self.fork_step}"] if self.fork_step is not None else []
        for name, r in self.results.items():
            s = r.summary()
            rows.append(
                f"  {name}: policy={r.policy}, steps={s['num_steps']}, ttft_steps p50/p90/p99="
                f"{s['ttft_steps_p50']:g}/{s['ttft_steps_p90']:g}/{s['ttft_steps_p99']:g}, e2e_steps p50="
                f"{s['e2e_steps_p50']:g}, preemptions={s['num_preemptions']}, "
                f"recomputed_tokens={s['num_recomputed_tokens']}"
            )
        return f"Comparison({len(self.workload)} requests, {len(self.results)} configs:\n" + "\n".join(rows) + ")"

    def _repr_html_(self) -> str:
        return (
            f"<div><b>Comparison</b>: {len(self.workload)} requests under "
            f"{', '.join(html.escape(n) for n in self.results)}"
            + self.table.to_html(float_format=lambda v: f"{v:.4g}")
            + "</div>"
        )


def compare_runs(
    workload: Workload,
    configs: Mapping[str, EngineConfig | dict],
    *,
    base: EngineConfig | None = None,
    clock: str | None = None,
    progress: bool = False,
    simulate: bool = False,
    cost_model=None,
) -> Comparison:
    """Run ``workload`` once per named configuration (an EngineConfig, or a dict of
    overrides on ``base``, default ``EngineConfig()``) and return a :class:`Comparison`.
    Every configuration is checked before the first run starts. ``simulate`` and
    ``cost_model``: as :func:`run_workload`."""
    if not isinstance(configs, Mapping) or not configs:
        raise ValueError("configs must be a non-empty dict of name -> EngineConfig or dict of overrides.")
    resolved = {}
    for name, config in configs.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"config names must be non-empty strings, got {name!r}.")
        try:
            resolved[name] = resolve_config(config, base)
        except (TypeError, ValueError) as e:
            raise ValueError(f"config {name!r}: {e}") from None
    results = {name: run_workload(workload, config, clock=clock, progress=progress, simulate=simulate,
                                  cost_model=cost_model)
               for name, config in resolved.items()}
    return Comparison(workload, results)


def compare_branches(run: RunResult, branches: Mapping[str, RunResult], *, name: str = "original") -> Comparison:
    """A :class:`Comparison` of ``run`` (as ``name``) and its ``branches`` (``run.fork_at(...)``
    results, by name), all forked at one step (``fork_step``, marked on the timelines)."""
    if not isinstance(branches, Mapping) or not branches:
        raise ValueError("branches must be a non-empty dict of name -> RunResult of run.fork_at(...).")
    steps = {b.fork_step for b in branches.values()}
    if None in steps or len(steps) != 1:
        raise ValueError(f"branches must all come from one fork_at step; their fork steps are "
                         f"{sorted(steps, key=lambda s: -1 if s is None else s)}.")
    if name in branches:
        raise ValueError(f"name {name!r} is also a branch's name.")
    return Comparison(run.workload, {name: run, **branches}, fork_step=steps.pop())
