"""The cluster timeline: lanes, stacking and bar times of a run worked out by hand."""

import pytest

from workbench.cluster import Cluster
from workbench.lab.sim import CostModel
from workbench.lab.workload import Workload, WorkloadRequest
from workbench.sampling_params import SamplingParams
from workbench.viz import ClusterTimeline
from workbench.viz.cluster_timeline import lane_rows


def _req(rid, max_tokens, t):
    return WorkloadRequest(rid, (5, 6, 7, 8), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           arrival_time=t)


def test_lanes_rows_and_times():
    """As tests/cluster/test_regret.py: a and c on replica 0 (c overlaps a: second row), b on 1.
    c arrives .006, scheduled .010, first token .020, done .030."""
    wl = Workload([_req("a", 3, 0.0), _req("b", 1, 0.005), _req("c", 2, 0.006)], clock="wall")
    result = Cluster.simulated(2, {"block_size": 4, "num_kv_blocks": 16}, cost_model=CostModel({"step": 0.010})).run(wl)
    lanes = lane_rows(result)
    assert [[b["request_id"] for b in lane] for lane in lanes] == [["a", "c"], ["b"]]
    a, c = lanes[0]
    assert (a["row"], c["row"], c["rows"]) == (0, 1, 2)
    assert (c["arrival"], c["scheduled"], c["first_token"], c["finished"]) == pytest.approx((0.006, 0.010, 0.020, 0.030))
    view = ClusterTimeline(result)
    assert view.lanes == [["a", "c"], ["b"]]
    assert view.image.value[:4] == b"\x89PNG" and "<img" in view._repr_html_()
