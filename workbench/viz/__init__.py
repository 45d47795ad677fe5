"""Plots and widgets that read StepRecords and the live engine objects (never the other way round)."""

from workbench.viz.plots import plot_kv_blocks, plot_kv_usage, plot_step_tokens
from workbench.viz.dashboard import EngineDashboard

__all__ = ["plot_step_tokens", "plot_kv_usage", "plot_kv_blocks", "EngineDashboard"]
