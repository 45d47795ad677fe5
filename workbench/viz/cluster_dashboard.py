"""ClusterDashboard: a cluster run in tabs -- the replicas (load, latencies, prefix hit rate,
the cluster's summary with its goodput when an SLO is given), the cluster timeline, and the
router player (every decision, every candidate, the regret of a choice on request).

Each tab is drawn when first picked (the router player replays the run once to read the
candidates' states), so opening the dashboard on a large run costs only the first tab.
"""

from __future__ import annotations

import html

import ipywidgets as widgets

from workbench.viz.cluster_timeline import ClusterTimeline
from workbench.viz.router_player import RouterPlayer

TABS = ("replicas", "timeline", "decisions")


class ClusterDashboard(widgets.VBox):
    """The tabs of ``result`` (a ClusterResult); ``summary_kwargs`` go to ``result.summary``."""

    def __init__(self, result, **summary_kwargs) -> None:
        self.result = result
        self.summary = result.summary(**summary_kwargs)
        self.player: RouterPlayer | None = None
        self.timeline: ClusterTimeline | None = None
        self.tabs = widgets.Tab(children=[widgets.HTML(self._replicas_html()), widgets.VBox(), widgets.VBox()])
        for i, title in enumerate(TABS):
            self.tabs.set_title(i, title)
        self.tabs.observe(lambda change: self._open(change["new"]), names="selected_index")
        super().__init__([widgets.HTML(f"<b>{html.escape(repr(result))}</b>"), self.tabs])

    def _replicas_html(self) -> str:
        s = self.summary
        keys = [k for k in s if not k.startswith("load_")]
        summary = "".join(f"<tr><td>{html.escape(k)}</td><td>{s[k]:.4g}</td></tr>" for k in keys)
        per = self.result.per_replica().to_html(index=False, float_format=lambda v: f"{v:.4g}")
        return f"{per}<table>{summary}</table>"

    def _open(self, index: int | None) -> None:
        if index == 1 and self.timeline is None:
            self.timeline = ClusterTimeline(self.result)
            self.tabs.children[1].children = [self.timeline]
        elif index == 2 and self.player is None:
            self.player = RouterPlayer(self.result)
            self.tabs.children[2].children = [self.player]

    def _repr_html_(self) -> str:
        return f"<div><b>{html.escape(repr(self.result))}</b>{self._replicas_html()}</div>"
