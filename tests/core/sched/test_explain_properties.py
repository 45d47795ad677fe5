"""On random workloads the recorded reasons agree with what the scheduler did, step by step.

Checked after every ``schedule()`` against the step's output and the state it left:
* coverage: every waiting request, every running request left out and every chunk short of
  its request's last known token has a reason; a chunk that reaches it has none;
* each reason holds: "KV short" -- the blocks needed exceed the free blocks, as many as the
  pool has free now; "token budget" -- the step's chunks spent exactly the budget;
  "max_num_seqs" -- that many are running; "chunked prefill" -- the chunk's size, or a whole
  prompt larger than the budget left; "behind" -- the request ahead could not be scheduled;
  "preempted" / "preemption in step" -- the step's preemptions;
* one prefix lookup per admission, matching the chunk's cached tokens; an "evicted" block's
  hash is no longer cached.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.core.kv_cache_manager import KVCacheManager
from workbench.core.sched.explain import MissCause, Reason
from workbench.core.sched.scheduler import Scheduler
from workbench.request import Request, RequestStatus
from workbench.sampling_params import SamplingParams

BASE = list(range(1, 41))

request_st = st.tuples(st.integers(0, 6), st.integers(0, 16), st.lists(st.integers(0, 3), max_size=8),
                       st.integers(1, 10), st.integers(0, 3))
config_st = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4]),
    "num_blocks": st.integers(6, 20),
    "budget": st.integers(4, 24),
    "max_num_seqs": st.integers(1, 5),
    "chunked": st.booleans(),
    "caching": st.booleans(),
    "policy": st.sampled_from(["fcfs", "priority", "spf"]),
})


def check(s: Scheduler, out, cfg) -> None:
    why = out.explanation
    reasons = why.reasons
    chunks = {c.request_id: c for c in out.scheduled}
    for r in s.waiting:
        assert r.request_id in reasons, f"waiting {r.request_id} has no reason"
    for r in s.running:
        c = chunks.get(r.request_id)
        if c is None:
            assert r.request_id in reasons, f"running {r.request_id} left out without a reason"
        elif c.num_computed_tokens + c.num_new_tokens - len(c.spec_token_ids) < r.num_tokens:
            assert reasons[r.request_id].reason is Reason.CHUNKED_PREFILL
            assert reasons[r.request_id].num_scheduled == c.num_new_tokens
            assert reasons[r.request_id].num_remaining == r.num_tokens - c.num_computed_tokens
        else:
            assert r.request_id not in reasons
    preempted = set(out.preempted_request_ids)
    for rid, w in reasons.items():
        kind = w.reason
        if kind is Reason.KV_BLOCKS_SHORT:
            assert w.blocks_needed > w.blocks_free == s.kv_cache.num_free_blocks
            assert 0 <= w.blocks_evictable <= w.blocks_free
        elif kind is Reason.TOKEN_BUDGET:
            assert out.total_num_scheduled_tokens == cfg["budget"] == sum(n for _, n in w.spent_by)
        elif kind is Reason.MAX_NUM_SEQS:
            assert len(s.running) == cfg["max_num_seqs"] == w.num_running
        elif kind is Reason.CHUNKED_PREFILL:
            if rid in chunks:  # a chunk (checked above for running requests)
                assert chunks[rid].num_new_tokens == w.num_scheduled < w.num_remaining
                continue
            assert w.whole_prompt_required and not cfg["chunked"]
            assert w.num_remaining > w.budget_left == cfg["budget"] - out.total_num_scheduled_tokens
        elif kind is Reason.BEHIND_IN_ORDER:
            ahead = reasons[w.blocked_by]
            if w.queue == "waiting":
                assert ahead.reason in (Reason.KV_BLOCKS_SHORT, Reason.CHUNKED_PREFILL)
            else:
                assert w.blocked_by in preempted and ahead.reason is Reason.PREEMPTED
        elif kind is Reason.PREEMPTED:
            assert rid in preempted and s.requests[rid].status is RequestStatus.PREEMPTED
        elif kind is Reason.PREEMPTION_IN_STEP:
            assert preempted and not out.new_request_ids and not out.resumed_request_ids
        else:
            raise AssertionError(f"{rid}: unexpected reason {w!r}")
    assert {p.request_id for p in why.preemptions} == preempted
    admitted = (*out.new_request_ids, *out.resumed_request_ids)
    if cfg["caching"]:
        assert sorted(p.request_id for p in why.prefix_lookups) == sorted(admitted)
    for p in why.prefix_lookups:
        assert p.num_blocks_matched * cfg["block_size"] == chunks[p.request_id].num_cached_tokens
        if p.miss is MissCause.EVICTED:
            h = s.requests[p.request_id].block_hashes[p.miss_block]
            assert s.kv_cache.pool.get_cached_block(h) is None
            assert p.evicted_at_step < out.step + 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, specs=st.lists(request_st, min_size=2, max_size=9))
def test_reasons_agree_with_the_schedule(cfg, specs):
    bs = cfg["block_size"]
    s = Scheduler(KVCacheManager(cfg["num_blocks"], bs, enable_prefix_caching=cfg["caching"]),
                  max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["budget"],
                  max_model_len=64, enable_chunked_prefill=cfg["chunked"], policy=cfg["policy"])
    for step in range(400):
        for i, (arrival, prefix, suffix, max_tokens, priority) in enumerate(specs):
            if arrival == step:
                try:
                    s.add_request(Request(f"r{i}", BASE[:prefix] + suffix or [0],
                                          SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                          priority=priority, arrival_time=float(i)))
                except ValueError:
                    pass
        if step > 6 and not s.has_unfinished_requests():
            break
        out = s.schedule()
        check(s, out, cfg)
        s.update_from_output(out, {c.request_id: (step + len(c.request_id)) % 5
                                   for c in out.scheduled if c.samples})
    assert not s.has_unfinished_requests()
