"""ComparisonView: several engine configs on one workload, side by side.

It shows a :class:`~workbench.compare.Comparison`: the table (p50/p90/p99 latencies,
throughput, preemptions, recomputed tokens per config), the CDF of a latency metric, the
configs' request timelines on one step axis (each request on the same row and in the same
colour in every panel) and a :class:`StepPlayer` over the run picked.
"""

from __future__ import annotations

import ipywidgets as widgets
import traitlets

from workbench.viz.figures import figure_png, new_figure
from workbench.viz.player import StepPlayer
from workbench.viz.timeline import draw_timeline, request_spans, timeline_height, timeline_legend

METRICS = ("ttft_s", "tpot_s", "e2e_s", "queue_s", "ttft_steps", "e2e_steps")


def aligned_timelines(results: dict, width: float = 12.0):
    """One timeline panel per run, sharing the step axis and the request rows."""
    spans = {name: request_spans(result.history[:]) for name, result in results.items()}
    rows: list[str] = []
    for run_rows, _ in spans.values():
        rows += [r for r in run_rows if r not in rows]
    panel = timeline_height(len(rows)) - 0.8
    figure = new_figure(width, 0.8 + panel * len(results))
    axes = figure.subplots(len(results), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, (_, run_spans)) in zip(axes, spans.items()):
        draw_timeline(ax, rows, run_spans, title=name)
    timeline_legend(figure)
    return figure


class ComparisonView(widgets.VBox):
    """``ComparisonView(compare_runs(workload, {"fcfs": ..., "spf": ...}))``.

    ``table_html`` is the table shown, ``metric`` the CDF drawn, ``run`` the run in the player.
    """

    table_html = traitlets.Unicode("")
    metric = traitlets.Unicode("ttft_s")
    run = traitlets.Unicode("")

    def __init__(self, comparison, *, metric: str = "ttft_s"):
        self.comparison = comparison
        names = list(comparison.results)
        self.table = widgets.HTML()
        self.metric_picker = widgets.Dropdown(options=[m for m in METRICS if m in _columns(comparison)],
                                              value=metric, description="CDF of")
        self.cdf = widgets.Image(format="png")
        self.timelines = widgets.Image(format="png")
        self.run_picker = widgets.Dropdown(options=names, value=names[0], description="player")
        self.player_box = widgets.VBox()
        self.metric_picker.observe(lambda change: self.show_metric(change["new"]), "value")
        self.run_picker.observe(lambda change: self.show_run(change["new"]), "value")
        tabs = widgets.Tab([
            widgets.VBox([self.table, self.metric_picker, self.cdf]),
            self.timelines,
            widgets.VBox([self.run_picker, self.player_box]),
        ])
        for i, title in enumerate(("Table and CDF", "Timelines", "Step player")):
            tabs.set_title(i, title)
        super().__init__([tabs])
        self.refresh()

    def refresh(self) -> None:
        table = self.comparison.table
        self.table_html = table.to_html(float_format=lambda v: f"{v:.4g}")
        self.table.value = "<b>One workload, several configs</b>" + self.table_html
        self.timelines.value = figure_png(aligned_timelines(self.comparison.results))
        self.show_metric(self.metric)
        self.show_run(self.run_picker.value)

    def show_metric(self, metric: str) -> None:
        self.metric = metric
        self.cdf.value = figure_png(self.comparison.cdf_figure(metric=metric))

    def show_run(self, name: str) -> None:
        self.run = name
        old = list(self.player_box.children)
        self.player_box.children = [StepPlayer(self.comparison.results[name], live_updates=False)]
        for player in old:
            player.close()

    def __repr__(self) -> str:
        return f"ComparisonView(runs={list(self.comparison.results)}, metric={self.metric})"


def _columns(comparison) -> set[str]:
    columns: set[str] = set()
    for result in comparison.results.values():
        columns |= set(result.requests.columns)
    return columns
