"""Capacity of a cluster: replicas a workload needs (a schedule worked by hand), the highest
rate meeting an SLO (the goodput in the summary), and the routers x replicas x workloads sweep."""

import concurrent.futures

import pytest

from workbench.cluster import Cluster
from workbench.cluster.capacity import cluster_capacity, replicas_needed
from workbench.cluster.shared_prefix import shared_prefix_workload
from workbench.cluster.sweep import cluster_sweep
from workbench.lab.sim import CostModel
from workbench.lab.workload import Workload, WorkloadRequest
from workbench.sampling_params import SamplingParams

TEN_MS = CostModel({"step": 0.010})
ONE_AT_A_TIME = {"block_size": 4, "num_kv_blocks": 64, "max_num_seqs": 1, "max_num_batched_tokens": 32}


def test_replicas_needed_by_hand():
    """8 requests at t=0, 3 tokens each (3 steps of 10 ms), one at a time per replica, round
    robin. e2e p50: 1 replica 135 ms (30..240), 2: 75 ms, 4: 45 ms, 3 (3+3+2): 60 ms. Under 50 ms:
    4 replicas, found by trying 1, 2, 4, then 3."""
    wl = Workload([WorkloadRequest(f"r{i}", (5, 6, 7, 8), SamplingParams(max_tokens=3, ignore_eos=True),
                                   arrival_time=0.0) for i in range(8)], clock="wall")
    found = replicas_needed(Cluster.simulated(1, ONE_AT_A_TIME, cost_model=TEN_MS), wl, {"e2e_s_p50": 0.05})
    assert found.replicas == 4
    table = found.table.set_index("replicas")
    assert list(table.index) == [1, 2, 3, 4] and list(table["holds"]) == [False, False, False, True]
    assert table["e2e_s_p50"].tolist() == pytest.approx([0.135, 0.075, 0.060, 0.045])
    assert replicas_needed(Cluster.simulated(1, ONE_AT_A_TIME, cost_model=TEN_MS), wl, {"e2e_s_p50": 0.01},
                           max_replicas=2).replicas is None  # 30 ms at best
    with pytest.raises(ValueError, match="simulated cluster"):
        replicas_needed(Cluster([ONE_AT_A_TIME]), wl, {"e2e_s_p50": 0.05})


def test_capacity_is_the_edge_and_the_summary_goodput():
    wl = shared_prefix_workload(60, 50.0, num_groups=3, prefix_len=32, input_len=(40, 56), output_len=(4, 8))
    cluster = Cluster.simulated(2, {"block_size": 16, "num_kv_blocks": 64}, router="cache_aware")
    slo = {"ttft_s_p99": 0.02}
    found = cluster_capacity(cluster, wl, slo, headroom=0.0)
    assert found.bounded and found.rate > 0
    assert cluster.run(wl.at_rate(found.rate)).summary()["ttft_s_p99"] <= 0.02
    above = found.table[found.table["rate"] > found.rate]["rate"].min()
    assert above / found.rate - 1 <= 0.05 + 1e-9
    assert cluster.run(wl.at_rate(above)).summary()["ttft_s_p99"] > 0.02
    s = cluster.run(wl).summary(slo=slo)
    assert s["goodput"] == found.rate and s["slo_met"] == (s["ttft_s_p99"] <= 0.02)


def test_sweep_rows_are_the_runs():
    wl = shared_prefix_workload(40, 100.0, num_groups=3, prefix_len=32, input_len=(40, 56), output_len=(4, 8))
    config = {"block_size": 16, "num_kv_blocks": 64}
    frame = cluster_sweep({"shared": wl}, ["round_robin", "cache_aware"], [2, 3], config)
    assert list(zip(frame["router"], frame["replicas"])) == [("round_robin", 2), ("round_robin", 3),
                                                             ("cache_aware", 2), ("cache_aware", 3)]
    assert frame["error"].isna().all()
    for row in frame.itertuples():
        s = Cluster.simulated(row.replicas, config, router=row.router).run(wl).summary()
        assert row.prefix_hit_rate == s["prefix_hit_rate"] and row.ttft_s_p99 == s["ttft_s_p99"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        again = cluster_sweep({"shared": wl}, ["round_robin", "cache_aware"], [2, 3], config, executor=pool)
    assert again.drop(columns="error").equals(frame.drop(columns="error"))
    with pytest.raises(ValueError, match="routers must be names"):
        cluster_sweep(wl, ["fastest"], [2])
    with pytest.raises(ValueError, match="replicas must be integers"):
        cluster_sweep(wl, ["round_robin"], [0])
