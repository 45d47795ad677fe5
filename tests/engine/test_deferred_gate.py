"""vLLM issue #53130 reproduced: with DeferredGatePolicy (deferred requests hold seats of
max_num_seqs, and one aborted while its grammar compiles is never released) admission stops for
good with KV blocks free; explain() names the gate at the step the stall starts; the same
engine forked with the built-in gate drains its queue.

Worked by hand (max_num_seqs 3, 32 blocks of 8): a (10 tokens, 6 outputs) and b (10, 6) arrive
with g1, g2 -- constrained requests, each a grammar not compiled before, aborted at once: 2
seats leak. Step 0 admits a (0 + 2 < 3), not b (1 + 2 = 3). g3 leaks a third seat at step 2.
a finishes at step 5 (prefill + 5 decodes); from step 6 nothing runs and nothing is admitted
(0 + 3 = 3): the stall. With fcfs, b is admitted at the next step and finishes 5 steps later.
"""

from __future__ import annotations

from workbench.config import EngineArgs
from workbench.core.sched.deferred_gate import DeferredGatePolicy
from workbench.core.sched.explain import MaxNumSeqsReached
from workbench.engine.fork import apply_scheduling
from workbench.engine.llm_engine import LLMEngine
from workbench.sampling_params import SamplingParams, StructuredOutputsParams


def test_deferred_seats_leak_into_a_stall_that_explain_names_and_fcfs_drains():
    engine = LLMEngine(EngineArgs(device="cpu", block_size=8, num_kv_blocks=32, max_num_seqs=3,
                                  policy=DeferredGatePolicy()))
    plain = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)

    def deferred_then_aborted(rid):  # a grammar of its own: it is compiling when it arrives
        so = StructuredOutputsParams(choice=["yes", "no", rid])
        engine.add_request(rid, {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, structured_outputs=so))
        engine.abort_request(rid)

    engine.add_request("a", {"prompt_token_ids": list(range(10, 20))}, plain)
    deferred_then_aborted("g1")
    deferred_then_aborted("g2")
    engine.add_request("b", {"prompt_token_ids": list(range(30, 40))}, plain)
    for step in range(12):
        if step == 2:
            deferred_then_aborted("g3")
        engine.step()
    reasons = [r.reasons.get("b") for r in engine.history]
    assert reasons == [MaxNumSeqsReached(3, 1, 2)] * 2 + [MaxNumSeqsReached(3, 1, 3)] * 4 + [
        MaxNumSeqsReached(3, 0, 3)] * 6
    assert "Steps 6-11: waiting, because 0 requests were running and the policy counted 3 seats held by " \
           "deferred requests, max_num_seqs=3." in str(engine.explain("b"))
    assert engine.kv_cache.num_free_blocks == 32  # the stall is not memory
    stalled, fixed = engine.fork(), engine.fork()
    apply_scheduling(fixed, policy="fcfs")
    for _ in range(6):
        stalled.step(), fixed.step()
    assert stalled.has_unfinished_requests() and not stalled.history[-1].scheduler_output.scheduled
    assert not fixed.has_unfinished_requests()
    assert [r.step for r in fixed.history if any(c.request_id == "b" for c in r.scheduler_output.scheduled)] == \
        list(range(12, 18))
