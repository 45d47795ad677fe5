"""fork and outcome regret: the latency the other choice would have made, worked out by hand."""

import pytest

from workbench.cluster import Cluster
from workbench.lab.sim import CostModel
from workbench.lab.workload import Workload, WorkloadRequest
from workbench.sampling_params import SamplingParams

TEN_MS = CostModel({"step": 0.010})


def _req(rid, max_tokens, t):
    return WorkloadRequest(rid, (5, 6, 7, 8), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           arrival_time=t)


def test_regret_by_hand():
    """10 ms a step, round robin over 2 replicas. a (t=0, 3 tokens) -> 0: tokens at .01 .02 .03.
    b (t=.005, 1 token) -> 1: its step runs .005-.015. c (t=.006, 2 tokens) -> 0, busy until .01:
    joins a's batch, tokens at .02 and .03 (ttft .014, e2e .024). Forked to replica 1, c waits for
    b's step to end at .015: tokens at .025 and .035 (ttft .019, e2e .029): 5 ms worse for c,
    a and b unchanged (mean e2e + .005 / 3)."""
    wl = Workload([_req("a", 3, 0.0), _req("b", 1, 0.005), _req("c", 2, 0.006)], clock="wall")
    run = Cluster.simulated(2, {"block_size": 4, "num_kv_blocks": 16}, cost_model=TEN_MS).run(wl)
    assert list(run.decisions["replica"]) == [0, 1, 0]
    fork = run.fork("c", 1)
    assert list(fork.decisions["replica"]) == [0, 1, 1] and list(fork.decisions["router_choice"]) == [0, 1, 0]
    regret = run.regret(sample=3).set_index("request_id")
    assert list(regret.index) == ["a", "b", "c"]
    c = regret.loc["c"]
    assert (c["replica"], c["alternative"]) == (0, 1)
    assert c["ttft_delta"] == pytest.approx(0.005) and c["e2e_delta"] == pytest.approx(0.005)
    assert c["mean_e2e_delta"] == pytest.approx(0.005 / 3)
    with pytest.raises(ValueError, match="replica must be"):
        run.fork("c", 2)
    with pytest.raises(ValueError, match="was not routed"):
        run.fork("zz", 0)
