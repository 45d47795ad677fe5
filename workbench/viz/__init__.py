"""Widgets and plots that read StepRecords and the live engine (never the other way round).

``BlockMap``, ``RequestTimeline``, ``StepPlayer``, ``EngineDashboard``, ``ComparisonView``, ``ClusterTimeline``,
``RouterPlayer`` and ``ClusterDashboard``
are ipywidgets; the ``plot_*`` functions draw on a matplotlib Axes.
"""

from workbench.viz.block_map import BlockMap
from workbench.viz.cluster_dashboard import ClusterDashboard
from workbench.viz.cluster_timeline import ClusterTimeline, plot_cluster_timeline
from workbench.viz.comparison import ComparisonView
from workbench.viz.dashboard import EngineDashboard
from workbench.viz.player import StepPlayer
from workbench.viz.plots import plot_kv_blocks, plot_kv_usage, plot_step_tokens
from workbench.viz.router_player import RouterPlayer
from workbench.viz.timeline import RequestTimeline

__all__ = [
    "BlockMap", "ClusterDashboard", "ClusterTimeline", "RequestTimeline", "StepPlayer", "EngineDashboard", "ComparisonView", "RouterPlayer",
    "plot_step_tokens", "plot_kv_usage", "plot_kv_blocks", "plot_cluster_timeline",
]
