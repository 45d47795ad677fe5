"""explain(request_id): a live engine, its run replayed and the same workload simulated tell
the same story; the story of a small run, worked out by hand; bad input.

The workload (block_size 4, 10 blocks, budget 16, max_num_seqs 3): a and b share an 8-token
prefix, c arrives at step 1 sharing it too, d (14 private tokens) at step 2.
"""

from __future__ import annotations

import pytest

from workbench import SamplingParams, teaching_config
from workbench.engine.llm_engine import LLMEngine
from workbench.lab.compare import run_workload
from workbench.lab.sim import CostModel, simulate
from workbench.lab.workload import Workload, WorkloadRequest

CFG = teaching_config(num_kv_blocks=10, enable_prefix_caching=True, max_num_batched_tokens=16, max_num_seqs=3)
SHARED = list(range(11, 19))
PROMPTS = {"a": (SHARED + [30, 31, 32], 10, 0), "b": (SHARED + [40] * 5, 10, 0),
           "c": (SHARED + [50, 51], 8, 1), "d": ([60 + i for i in range(14)], 8, 2)}
PARAMS = dict(temperature=0.0, ignore_eos=True)
WORKLOAD = Workload([WorkloadRequest(rid, tuple(p), SamplingParams(max_tokens=m, **PARAMS), arrival_step=s)
                     for rid, (p, m, s) in PROMPTS.items()])


@pytest.fixture(scope="module")
def run():
    return run_workload(WORKLOAD, CFG)


def test_live_replayed_and_simulated_explanations_agree(run):
    engine = LLMEngine(CFG)
    step = 0
    while step < 3 or engine.has_unfinished_requests():
        for rid, (prompt, max_tokens, arrival) in PROMPTS.items():
            if arrival == step:
                engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens, **PARAMS))
        engine.step()
        step += 1
    replayed = run.fork_at(0)
    simulated = simulate(WORKLOAD, CFG, CostModel({"step": 0.01}))
    for rid in PROMPTS:
        told = run.explain(rid)
        for other in (engine.explain(rid), replayed.explain(rid), simulated.explain(rid)):
            assert str(other) == str(told), rid
            assert other.table.equals(told.table), rid
    assert [r.reasons for r in engine.history] == [r.reasons for r in run.history]


def test_story_of_c_by_hand(run):
    why = run.explain("c")
    # step 1: c hits the two shared blocks and computes its 2 own tokens (block 2 is partial);
    # steps 2-4 decode; at step 5 b's growth preempts c (the newest running arrival); c waits
    # on KV blocks, then on step 9's preemption, and resumes at step 10.
    table = why.table
    assert list(table.columns) == ["step", "state", "reason", "tokens", "numbers", "note"]
    assert table.loc[table.step == 1, "note"].item() == (
        "c's prefix lookup reused 2 blocks; block 2 is a partial block (only full blocks are cached)")
    assert list(table.state[table.step.between(5, 10)]) == ["preempted", "waiting", "waiting", "waiting",
                                                            "waiting", "scheduled"]
    assert list(table.reason[table.step.between(5, 9)]) == ["preempted"] + ["kv_blocks_short"] * 3 + [
        "preemption_in_step"]
    assert table.loc[table.step == 6, "numbers"].item() == {
        "blocks_needed": 2, "blocks_free": 0, "blocks_evictable": 0, "num_hit_blocks": 2}
    text = str(why).splitlines()
    assert text[0] == "Request c:"
    assert "Steps 6-8: waiting, because KV blocks were short: it needed 2, 0 were free" in str(why)
    assert str(run.history.explain("c", step=9)) == (
        "Request c at step 9:\nStep 9: waiting, because this step preempted b, so no waiting request was admitted.")


def test_unknown_request_or_step(run):
    with pytest.raises(ValueError, match="'zz' is not in the recorded steps"):
        run.explain("zz")
    with pytest.raises(ValueError, match="'d' is not in step 0"):
        run.history.explain("d", step=0)
