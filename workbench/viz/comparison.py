"""ComparisonView: several engine configs on one workload, side by side.

It shows a :class:`~workbench.lab.compare.Comparison`: the table (p50/p90/p99 latencies,
throughput, preemptions, recomputed tokens per config), the CDF of a latency metric, the
configs' request timelines on one step axis (each request on the same row and in the same
colour in every panel; branches of one run with their fork step marked) and a
:class:`StepPlayer` over the run picked.
"""

from __future__ import annotations

import ipywidgets as widgets
import traitlets

from workbench.lab.compare import METRIC_LABELS
from workbench.viz.figures import figure_png, new_figure, png_img
from workbench.viz.player import StepPlayer
from workbench.viz.timeline import draw_timeline, empty_steps, request_spans, timeline_height, timeline_legend


#: The CDF's size in inches, drawn at 100 dpi and shown at that size.
CDF_SIZE = (6.0, 3.6)

#: The compact table: (row label, summary keys joined as "p50 · p90 · p99" or one value).
_SHORT = {"ttft": "TTFT", "tpot": "TPOT", "e2e": "e2e latency", "queue": "queue time"}
COMPACT_ROWS = [
    (f"{_SHORT[metric.rsplit('_', 1)[0]]} ({metric.rsplit('_', 1)[1]})", [f"{metric}_p{p}" for p in (50, 90, 99)])
    for metric in METRIC_LABELS
] + [
    ("output tokens / step", ["throughput_tok_step"]),
    ("output tokens / s", ["throughput_tok_s"]),
    ("preemptions", ["num_preemptions"]),
    ("recomputed tokens", ["num_recomputed_tokens"]),
    ("prefix-cache hit rate", ["prefix_hit_rate"]),
    ("steps", ["num_steps"]),
]


def compact_table(table):
    """``Comparison.table`` as one column per config and one row per metric, percentiles
    joined in one cell (what the widget shows)."""
    import pandas as pd

    def cell(row, keys):
        return " · ".join(f"{row[k]:.3g}" if isinstance(row[k], float) else str(row[k]) for k in keys)

    return pd.DataFrame({name: {label: cell(row, keys) for label, keys in COMPACT_ROWS}
                         for name, row in table.iterrows()})


def aligned_timelines(results: dict, width: float = 12.0, fork_step: int | None = None):
    """One timeline panel per run, sharing the step axis (all runs' steps) and the request rows;
    branches of one run (``fork_step``) get a dashed line before the step they forked at."""
    records = {name: result.history[:] for name, result in results.items()}
    spans = {name: request_spans(run) for name, run in records.items()}
    kept = [run for run in records.values() if run]
    steps = (min(run[0].step for run in kept), max(run[-1].step for run in kept)) if kept else (0, 0)
    rows: list[str] = []
    for run_rows, _ in spans.values():
        rows += [r for r in run_rows if r not in rows]
    panel = timeline_height(len(rows)) - 0.8
    figure = new_figure(width, 0.8 + panel * len(results))
    axes = figure.subplots(len(results), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, (_, run_spans)) in zip(axes, spans.items()):
        draw_timeline(ax, rows, run_spans, steps=steps, empty=empty_steps(records[name]), title=name)
        if fork_step is not None:
            ax.axvline(fork_step - 0.5, color="black", linestyle="--", linewidth=1.2)
            ax.annotate(f"fork (step {fork_step})", (fork_step - 0.5, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(3, -10), textcoords="offset points", fontsize=8)
    timeline_legend(figure)
    return figure


class ComparisonView(widgets.VBox):
    """``ComparisonView(compare_runs(workload, {"fcfs": ..., "spf": ...}))``.

    ``table_html`` is the table shown (:func:`compact_table`; ``comparison.table`` has all),
    ``metric`` the CDF drawn, ``run`` the run in the player.
    """

    table_html = traitlets.Unicode("")
    metric = traitlets.Unicode("ttft_steps")
    run = traitlets.Unicode("")

    def __init__(self, comparison, *, metric: str = "ttft_steps"):
        self.comparison = comparison
        names = list(comparison.results)
        self.table = widgets.HTML()
        self.metric_picker = widgets.Dropdown(options=[(label, m) for m, label in METRIC_LABELS.items()],
                                              value=metric, description="CDF of",
                                              layout=widgets.Layout(width="360px"))
        self.cdf = widgets.Image(format="png")
        self.timelines = widgets.Image(format="png")
        self.run_picker = widgets.Dropdown(options=names, value=names[0], description="player")
        self.player_box = widgets.VBox()
        self.metric_picker.observe(lambda change: self.show_metric(change["new"]), "value")
        self.run_picker.observe(lambda change: self.show_run(change["new"]), "value")
        # Table and CDF side by side when the column is wide enough, else stacked (wrap);
        # neither shrinks: the CDF keeps its drawn size, the picker its width.
        self.table.layout = widgets.Layout(flex="0 0 auto", margin="0 16px 8px 0")
        self.cdf.layout = widgets.Layout(width=f"{CDF_SIZE[0] * 100:.0f}px", max_width="100%")
        tabs = widgets.Tab([
            widgets.HBox([self.table, widgets.VBox([self.metric_picker, self.cdf],
                                                   layout=widgets.Layout(flex="0 1 auto", min_width="0"))],
                         layout=widgets.Layout(flex_flow="row wrap", align_items="flex-start")),
            self.timelines,
            widgets.VBox([self.run_picker, self.player_box]),
        ])
        for i, title in enumerate(("Table and CDF", "Timelines", "Step player")):
            tabs.set_title(i, title)
        super().__init__([tabs])
        self.metric = metric
        self.refresh()

    def refresh(self) -> None:
        self.table_html = compact_table(self.comparison.table).to_html(classes="wb-compare")
        self.table.value = (f"<b>One workload ({len(self.comparison.workload)} requests), "
                            f"{len(self.comparison.results)} configs</b><br><small>latencies: "
                            "p50 · p90 · p99 over the requests</small>"
                            "<style>.wb-compare td, .wb-compare th {white-space: nowrap}</style>" + self.table_html)
        self.timelines.value = figure_png(aligned_timelines(self.comparison.results,
                                                            fork_step=getattr(self.comparison, "fork_step", None)))
        self.show_metric(self.metric_picker.value)
        self.show_run(self.run_picker.value)

    def show_metric(self, metric: str) -> None:
        """Draw the CDF of ``metric`` (a key of METRIC_LABELS); the picker follows."""
        if self.metric_picker.value != metric:
            self.metric_picker.value = metric  # its observer comes back here and draws
            return
        self.metric = metric
        self.cdf.value = figure_png(self.comparison.cdf_figure(metric=metric, figsize=CDF_SIZE), dpi=100)

    def show_run(self, name: str) -> None:
        self.run = name
        old = list(self.player_box.children)
        self.player_box.children = [StepPlayer(self.comparison.results[name], live_updates=False)]
        for player in old:
            player.close()

    def __repr__(self) -> str:
        return f"ComparisonView(runs={list(self.comparison.results)}, metric={self.metric})"

    def _repr_html_(self) -> str:
        return self.table.value + png_img(self.cdf.value) + png_img(self.timelines.value)

