"""Cluster: one replica is the plain engine; simulated and real replicas route alike; the loop by hand."""

import pytest

from workbench.cluster import Cluster
from workbench.engine.fork import first_divergence
from workbench.lab.run import run_real
from workbench.lab.sim import CostModel, simulate
from workbench.lab.workload import Workload, WorkloadRequest
from workbench.sampling_params import SamplingParams

TEN_MS = CostModel({"step": 0.010})
SMALL = {"block_size": 4, "num_kv_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 32}


def _req(rid, n_prompt, max_tokens, *, step=None, time=None, first=5):
    return WorkloadRequest(rid, tuple(range(first, first + n_prompt)),
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           arrival_step=step, arrival_time=time)


def test_one_real_replica_is_the_plain_engine_token_for_token_and_step_for_step():
    wl = Workload.poisson(6, rate=0.5, input_len=(10, 30), output_len=(3, 8), seed=2, num_prefix_groups=2,
                          prefix_len=8)
    plain = run_real(wl, SMALL)
    result = Cluster([SMALL], router="round_robin").run(wl)
    assert first_divergence(result.replicas[0].history, plain.history) is None
    assert result.replicas[0].num_steps == plain.num_steps
    assert {rid: o.outputs[0].token_ids for rid, o in result.outputs.items()} == \
           {rid: o.outputs[0].token_ids for rid, o in plain.outputs.items()}
    cols = ["request_id", "num_output_tokens", "ttft_steps", "e2e_steps", "num_cached_tokens"]
    assert result.requests[cols].equals(plain.requests[cols])
    assert result.replicas[0].prefix_hits == plain.prefix_hits > 0


def test_one_simulated_replica_is_simulate_on_the_wall_clock():
    wl = Workload.poisson(12, rate=40.0, input_len=(10, 40), output_len=(2, 12), seed=4, clock="wall",
                          num_prefix_groups=3, prefix_len=9, text=False)
    plain = simulate(wl, SMALL, TEN_MS)
    result = Cluster.simulated(1, SMALL, cost_model=TEN_MS).run(wl)
    assert first_divergence(result.replicas[0].history, plain.history) is None
    cols = ["request_id", "num_output_tokens", "arrival_s", "queue_s", "ttft_s", "e2e_s", "num_cached_tokens"]
    assert result.requests[cols].equals(plain.requests[cols])
    assert result.replicas[0].end_s == pytest.approx(plain.wall_s)


def test_simulated_and_real_clusters_route_alike():
    """least_requests reads the replicas' queues, so the same decisions need the same schedules."""
    wl = Workload.poisson(10, rate=1.5, input_len=(8, 20), output_len=(2, 9), seed=5)
    real = Cluster([SMALL] * 3, router="least_requests").run(wl)
    sim = Cluster.simulated(3, SMALL, cost_model=TEN_MS, router="least_requests").run(wl)
    assert list(sim.decisions["replica"]) == list(real.decisions["replica"])
    assert len(set(real.decisions["replica"])) == 3  # every replica served some
    assert [len(r.requests) for r in sim.replicas] == [len(r.requests) for r in real.replicas]
    assert [r.num_steps for r in sim.replicas] == [r.num_steps for r in real.replicas]


def test_the_event_loop_by_hand():
    """10 ms a step. a (t=0, 2 outputs) -> replica 0: steps at 0 and 0.010, done at 0.020.
    b (t=0.005) -> replica 1 (round robin), idle: its clock jumps to 0.005, tokens at 0.015,
    0.025, 0.035. c (t=0.012) -> replica 0, busy (its step 0.010..0.020 runs past 0.012): taken at
    the boundary 0.020, first token 0.030 (ttft 0.018)."""
    wl = Workload([_req("a", 4, 2, time=0.0), _req("b", 4, 3, time=0.005), _req("c", 4, 1, time=0.012)],
                  clock="wall")
    result = Cluster.simulated(2, SMALL, cost_model=TEN_MS).run(wl)
    req = result.requests.set_index("request_id")
    assert list(result.decisions["replica"]) == [0, 1, 0]
    assert req.loc["a", "ttft_s"] == pytest.approx(0.010)
    assert req.loc["b", "ttft_s"] == pytest.approx(0.010) and req.loc["b", "e2e_s"] == pytest.approx(0.030)
    assert req.loc["c", "queue_s"] == pytest.approx(0.008) and req.loc["c", "ttft_s"] == pytest.approx(0.018)
    assert [r.end_s for r in result.replicas] == pytest.approx([0.030, 0.035])
    s = result.summary()
    assert (s["load_0"], s["load_1"], s["imbalance"]) == (2, 1, pytest.approx(2 / 1.5))


def test_bad_input_is_refused_with_the_field_named():
    with pytest.raises(ValueError, match="replicas must be"):
        Cluster([])
    with pytest.raises(ValueError, match="n must be"):
        Cluster.simulated(0)
    with pytest.raises(ValueError, match="router must be"):
        Cluster.simulated(2, router="nope")


def test_precise_prefix_sees_each_replicas_live_prefix_cache_at_every_arrival():
    from workbench.cluster import PrecisePrefix

    seen = []

    class Checked(PrecisePrefix):
        def route(self, request, replicas):
            for r in replicas:
                live = {b.block_hash for b in r.engine.kv_cache.blocks if b.block_hash is not None}
                assert self.index.blocks.get(r.index, set()) == live
                seen.append(len(live))
            return super().route(request, replicas)

    wl = Workload.poisson(30, rate=30.0, input_len=(20, 40), output_len=(2, 6), seed=3, clock="wall",
                          num_prefix_groups=3, prefix_len=16, text=False)
    result = Cluster.simulated(3, {"block_size": 4, "num_kv_blocks": 24}, cost_model=TEN_MS, router=Checked()).run(wl)
    assert max(seen) > 0 and result.summary()["prefix_hit_rate"] > 0


def test_the_views_a_router_gets_are_the_replicas_as_they_are_now():
    """Views are made once per change (step, add, clock jump): every one handed to the router
    equals one read afresh from its engine at that arrival, on both clocks."""
    from workbench.cluster import ReplicaView, Router

    class Checking(Router):
        name = "checking"

        def __init__(self):
            self.seen = 0

        def route(self, request, replicas):
            for v in replicas:
                e = v.engine
                waiting, running = len(e.scheduler.waiting), len(e.scheduler.running)
                fresh = ReplicaView(v.index, waiting + running, waiting, running, e.kv_cache.usage,
                                    e.kv_cache.num_free_blocks, e.config.block_size, v.now, e)
                assert v == fresh
            self.seen += 1
            return self.seen % len(replicas)

    for clock in ("wall", "steps"):
        wl = Workload.poisson(40, rate=30.0, input_len=(10, 40), output_len=(2, 12), seed=5, clock=clock,
                              num_prefix_groups=3, prefix_len=9, text=False)
        result = Cluster.simulated(3, SMALL, cost_model=TEN_MS, router=Checking()).run(wl)
        assert result.summary()["num_finished"] == 40
        assert sorted(result.requests["replica"].value_counts().tolist()) == [13, 13, 14]
