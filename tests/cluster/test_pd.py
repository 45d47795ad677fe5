"""P/D clusters: vLLM's proxy flow over xPyD pools, llm-d's decider, and the tokens and
blocks a disaggregated run leaves (against a plain engine's tokens, and counts by hand)."""

import pytest

from workbench import LLMEngine, SamplingParams
from workbench.cluster import Cluster
from workbench.cluster.pd import PDProxy
from workbench.lab.sim import CostModel
from workbench.lab.workload import Workload, WorkloadRequest

TEN_MS = CostModel({"step": 0.010})
SMALL = {"block_size": 4, "num_kv_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 32}


def req(rid, prompt, max_tokens, t):
    return WorkloadRequest(rid, tuple(prompt), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           arrival_time=t)


def all_free(result):
    return all(r.history[-1].num_free_blocks == r.config.num_kv_blocks for r in result.replicas)


def test_real_1p1d_gives_the_plain_engines_tokens_and_frees_every_block():
    prompts = [list(range(5 + 100 * i, 5 + 100 * i + n)) for i, n in enumerate((13, 22, 9, 30))]  # no shared prefix
    wl = Workload([req(f"q{i}", p, 6, 0.001 * i) for i, p in enumerate(prompts)], clock="wall")
    config = {**SMALL, "dtype": "float32", "device": "cpu"}
    result = Cluster(prefill=[config], decode=[config], router="pd_proxy").run(wl)
    plain = LLMEngine(**config)
    for i, p in enumerate(prompts):
        plain.add_request(f"q{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    ref = {}
    while plain.has_unfinished_requests():
        ref.update({o.request_id: o.outputs[0].token_ids for o in plain.step() if o.finished})
    assert {rid: o.outputs[0].token_ids for rid, o in result.outputs.items()} == ref
    assert list(result.decisions["decode_replica"]) == [1, 1, 1, 1]
    assert list(result.decisions["replica"]) == [0, 0, 0, 0]  # every prompt computed on the prefill replica
    frame = result.requests
    assert len(frame) == 4 and set(frame["replica"]) == {1}  # one row per request: its decode leg
    transfers = [t for rec in result.replicas[1].history for t in rec.kv_connector_output.transfers]
    assert sorted(t.num_blocks for t in transfers) == sorted(-(-(len(p) - 1) // 4) for p in prompts)
    assert all_free(result)


def test_xpyd_pools_spread_prefills_and_decodes():
    wl = Workload.poisson(16, rate=200.0, input_len=(20, 40), output_len=(4, 8), seed=1, clock="wall")
    result = Cluster.simulated(config=SMALL, prefill=2, decode=2, router="pd_proxy", cost_model=TEN_MS).run(wl)
    d = result.decisions
    assert set(d["replica"]) == {0, 1} and set(d["decode_replica"]) == {2, 3}
    assert result.summary()["num_finished"] == 16
    assert set(result.requests["replica"]) <= {2, 3}
    assert all_free(result)
    # TTFT counts the prefill leg: no request's first token comes before its prefill step (10 ms)
    # plus its decode step (10 ms).
    assert (result.requests["ttft_s"] >= 0.020 - 1e-9).all()


def test_the_decider_keeps_a_mostly_cached_prompt_on_the_decode_replica():
    shared = list(range(100, 140))  # 10 blocks of 4
    wl = Workload([req("a", shared + [7, 8, 9], 4, 0.0), req("b", shared + [11, 12, 13], 4, 1.0),
                   req("c", list(range(300, 343)), 4, 2.0)], clock="wall")
    cluster = Cluster.simulated(config=SMALL, prefill=1, decode=1, router=PDProxy(threshold=8), cost_model=TEN_MS)
    d = cluster.run(wl).decisions
    # a: 43 uncached tokens > 8: disaggregated. b: 40 of its 43 cached on the decode replica
    # (the decode leg of a cached them): decode alone. c: nothing cached: disaggregated.
    assert list(d["replica"]) == [0, 1, 0]
    assert list(d["uncached_1"]) == [43, 3, 43]
    assert d["decode_replica"].isna().tolist() == [False, True, False]


def test_bad_pools_and_thresholds_name_the_field():
    with pytest.raises(ValueError, match="prefill"):
        Cluster(prefill=[], decode=[SMALL])
    with pytest.raises(ValueError, match="either replicas or prefill"):
        Cluster([SMALL], prefill=[SMALL], decode=[SMALL])
    with pytest.raises(ValueError, match="threshold"):
        PDProxy(threshold=-1)
    wl = Workload([req("a", range(5, 20), 3, 0.0)], clock="wall")
    with pytest.raises(ValueError, match="pd_proxy needs prefill and decode"):
        Cluster.simulated(2, SMALL, router="pd_proxy", cost_model=TEN_MS).run(wl)


def test_study_layouts_goodput_and_crossover_by_hand():
    from workbench.cluster.pd_study import crossover, layouts, slo_attainment

    assert list(layouts(3)) == ["colocated", "2P1D", "1P2D"] and layouts(3)["2P1D"] == (2, 1)
    with pytest.raises(ValueError, match="num_replicas"):
        layouts(1)
    # two requests at t=0 and 0.5 s on one 10 ms-per-step replica: both meet loose SLOs, the
    # goodput is 2 over the span from the first arrival to the last finish
    wl = Workload([req("a", range(5, 25), 3, 0.0), req("b", range(50, 70), 3, 0.5)], clock="wall")
    result = Cluster.simulated(1, SMALL, cost_model=TEN_MS).run(wl)
    end = max(r.end_s for r in result.replicas)
    got = slo_attainment(result, ttft_slo=1.0, tpot_slo=1.0)
    assert got["attainment"] == 1.0 and got["goodput"] == pytest.approx(2 / end)
    assert slo_attainment(result, ttft_slo=0.005, tpot_slo=1.0)["attainment"] == 0.0  # a step is 10 ms
    import pandas as pd
    table = pd.DataFrame([
        {"mix": "m", "layout": "colocated", "link_gbps": float("nan"), "goodput": 10.0},
        {"mix": "m", "layout": "1P1D", "link_gbps": 0.1, "goodput": 5.0},
        {"mix": "m", "layout": "1P1D", "link_gbps": 1.0, "goodput": 11.0},
        {"mix": "m", "layout": "1P1D", "link_gbps": 10.0, "goodput": 12.0}])
    (row,) = crossover(table).to_dict("records")
    assert row["slowest_winning_link_gbps"] == 1.0 and row["best_goodput"] == 12.0
