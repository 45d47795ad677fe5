"""Branches of one run in the comparison widgets: one step axis, the fork step marked."""

import matplotlib.pyplot as plt
import pytest

from workbench import Workload, compare_branches, teaching_config
from workbench.lab.sim import CostModel, simulate
from workbench.viz import ComparisonView
from workbench.viz.comparison import aligned_timelines


@pytest.fixture(scope="module")
def comparison():
    wl = Workload.poisson(num_requests=6, rate=2.0, input_len=(12, 28), output_len=(8, 14), seed=2)
    run = simulate(wl, teaching_config(num_kv_blocks=16, max_num_seqs=6), CostModel({"step": 0.01}))
    step = next(r.step for r in run.history if r.scheduler_output.preempted_request_ids)
    return compare_branches(run, {"spf": run.fork_at(step, policy="spf")})


def test_branch_timelines_share_the_step_axis_and_mark_the_fork(comparison):
    step = comparison.fork_step
    figure = aligned_timelines(comparison.results, fork_step=step)
    axes = figure.axes
    assert [ax.get_title() for ax in axes] == ["original", "spf"]
    assert axes[0].get_xlim() == axes[1].get_xlim()
    for ax in axes:  # one dashed vertical line just before the fork step, labelled
        marks = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
        assert [tuple(m.get_xdata()) for m in marks] == [(step - 0.5, step - 0.5)]
        assert any(t.get_text() == f"fork (step {step})" for t in ax.texts)
    assert not any(line.get_linestyle() == "--" for ax in aligned_timelines(comparison.results).axes
                   for line in ax.get_lines())
    assert plt.get_fignums() == []


def test_comparison_view_of_branches(comparison):
    view = ComparisonView(comparison)
    assert "<th>original</th>" in view.table_html and "<th>spf</th>" in view.table_html
    assert bytes(view.timelines.value).startswith(b"\x89PNG")
    assert f"forked at step {comparison.fork_step}" in repr(comparison)
    view.close()


def test_compare_branches_refuses_runs_of_other_forks(comparison):
    run, spf = comparison.results["original"], comparison.results["spf"]
    with pytest.raises(ValueError, match="one fork_at step"):
        compare_branches(run, {"spf": spf, "again": run})
    with pytest.raises(ValueError, match="also a branch's name"):
        compare_branches(run, {"original": spf})
