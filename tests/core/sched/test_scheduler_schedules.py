"""Hand-worked schedules: every expected token count and block table below was derived by hand
(the comments show the arithmetic), not captured from a run.

Conventions: block_size 4 unless said otherwise; a fresh pool hands out blocks 0, 1, 2, ...
in order; a freed request's blocks rejoin the back of the free queue tail block first. The
fake runner samples token 9 for every chunk that samples (no eos is set, so it never stops).
Each chunk is written as (request, first token, new tokens, block table, samples).
"""

import pytest

from workbench.core.kv_cache_manager import KVCacheManager
from workbench.core.sched.policies import SchedulingPolicy
from workbench.core.sched.scheduler import Scheduler
from workbench.request import Request, RequestStatus
from workbench.sampling_params import SamplingParams

TOKEN = 9


def make(num_blocks=16, block_size=4, budget=64, max_num_seqs=8, max_model_len=64,
         chunked=True, caching=True, policy="fcfs"):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_model_len, enable_chunked_prefill=chunked, policy=policy)


def add(s, rid, prompt, max_tokens, priority=0, arrival=0.0, **params):
    if isinstance(prompt, int):
        base = 100 * (ord(rid[0]) - ord("A") + 1)  # A: 100.., B: 200..: no accidental sharing
        prompt = list(range(base, base + prompt))
    r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
                priority=priority, arrival_time=arrival)
    s.add_request(r)
    return r


def step(s, sampled=TOKEN):
    """One engine step with the fake runner; invariants checked before and after update."""
    out = s.schedule()
    s.check_invariants(out)
    s.update_from_output(out, {c.request_id: sampled for c in out.scheduled if c.samples})
    s.check_invariants()
    return out


def chunks(out):
    return [(c.request_id, c.num_computed_tokens, c.num_new_tokens, list(c.block_ids), c.samples)
            for c in out.scheduled]


def run_and_compare(s, expected):
    for i, exp in enumerate(expected):
        out = step(s)
        assert out.step == i
        assert chunks(out) == exp, f"step {i}"


# --------------------------------------------------------------------------------------
def test_chunked_prefill_across_steps_with_shared_budget():
    # budget 6. A: 10-token prompt, B: 3-token prompt, both max_tokens 2.
    s = make(budget=6)
    a = add(s, "A", 10, 2)
    b = add(s, "B", 3, 2)
    expected = [
        # step 0: A gets min(10, 6) = 6 tokens -> ceil(6/4) = 2 blocks; budget spent, B waits.
        [("A", 0, 6, [0, 1], False)],
        # step 1: A's last 4 prompt tokens -> 3 blocks, samples; 2 tokens left for B -> [3].
        [("A", 6, 4, [0, 1, 2], True), ("B", 0, 2, [3], False)],
        # step 2: A decodes token 10 (11 tokens fit 3 blocks); B's last prompt token, samples.
        #         A has 2 outputs = max_tokens -> finished.
        [("A", 10, 1, [0, 1, 2], True), ("B", 2, 1, [3], True)],
        # step 3: B decodes token 3 (4 tokens fit 1 block); 2 outputs -> finished.
        [("B", 3, 1, [3], True)],
    ]
    run_and_compare(s, expected)
    out = step(s)
    assert out.scheduled == () and out.finished_request_ids == ("B",)
    assert a.output_token_ids == [TOKEN, TOKEN] and b.output_token_ids == [TOKEN, TOKEN]
    assert a.status is b.status is RequestStatus.FINISHED_LENGTH_CAPPED
    # Free queue: untouched 4..15, then A's blocks tail first (2, 1, 0), then B's 3.
    assert s.kv_cache.pool.free_queue.block_ids() == list(range(4, 16)) + [2, 1, 0, 3]
    assert not s.has_unfinished_requests()


def test_budget_exhaustion_and_is_prefill_flags():
    # budget 5, three 3-token prompts, max_tokens 2.
    s = make(budget=5)
    for rid in "ABC":
        add(s, rid, 3, 2)
    outs = []
    expected = [
        # step 0: A 3 tokens (budget 5 -> 2), B min(3, 2) = 2 tokens (budget 0); C waits.
        [("A", 0, 3, [0], True), ("B", 0, 2, [1], False)],
        # step 1: A decode 1 (budget 4); B last prompt token (3); C whole prompt 3 (0).
        #         A reaches 2 outputs -> finished.
        [("A", 3, 1, [0], True), ("B", 2, 1, [1], True), ("C", 0, 3, [2], True)],
        # step 2: B and C decode once each and finish.
        [("B", 3, 1, [1], True), ("C", 3, 1, [2], True)],
    ]
    for i, exp in enumerate(expected):
        outs.append(step(s))
        assert chunks(outs[-1]) == exp
    assert outs[0].total_num_scheduled_tokens == 5 and outs[1].total_num_scheduled_tokens == 5
    assert outs[0].new_request_ids == ("A", "B") and outs[1].new_request_ids == ("C",)
    # prefill iff the chunk holds a prompt token or more than one token
    assert [c.is_prefill for c in outs[1].scheduled] == [False, True, True]
    assert outs[2].finished_request_ids == ("A",)


def test_max_num_seqs_caps_the_batch():
    s = make(budget=64, max_num_seqs=2)
    for rid in "ABC":
        add(s, rid, 3, 1)
    # step 0: A and B admitted (2 = max_num_seqs), C waits although budget remains.
    #         Both finish at once (max_tokens 1): A frees [0], B frees [1] -> queue 2..15, 0, 1.
    # step 1: C admitted, takes block 2 from the front.
    run_and_compare(s, [
        [("A", 0, 3, [0], True), ("B", 0, 3, [1], True)],
        [("C", 0, 3, [2], True)],
    ])


def test_chunked_prefill_off_prompt_waits_whole():
    s = make(budget=8, chunked=False)
    add(s, "A", 6, 3)
    add(s, "B", 5, 1)
    run_and_compare(s, [
        # step 0: A whole (6, budget 2 left); B needs all 5 > 2 -> waits (no chunking).
        [("A", 0, 6, [0, 1], True)],
        # step 1: A decode token 6 (7 tokens, 2 blocks; budget 7); B whole 5 -> [2, 3].
        [("A", 6, 1, [0, 1], True), ("B", 0, 5, [2, 3], True)],
        # step 2: B finished (max_tokens 1); A decode token 7 (8 tokens, 2 blocks).
        [("A", 7, 1, [0, 1], True)],
    ])
    with pytest.raises(ValueError, match="max_num_batched_tokens=8 and chunked prefill is disabled"):
        add(s, "C", 9, 1)


def test_preemption_and_resume_under_tiny_pool():
    # 3 blocks of 4. A and B: 4-token prompts, max_tokens 6 (each needs ceil(9/4) = 3 blocks
    # at most, so each fits the pool alone). A arrived first. Prefix caching off.
    s = make(num_blocks=3, caching=False)
    a = add(s, "A", 4, 6, arrival=0.0)
    b = add(s, "B", 4, 6, arrival=1.0)
    A_tokens = list(range(100, 104))
    expected = [
        # step 0: both prompts, one block each: A [0], B [1]; free: [2].
        [("A", 0, 4, [0], True), ("B", 0, 4, [1], True)],
        # step 1: A's token 4 needs a 2nd block -> [0, 2]. B's needs one, none free ->
        #         FCFS victim = newest arrival = B itself: preempted, its block 1 freed.
        [("A", 4, 1, [0, 2], True)],
        # steps 2-4: A decodes tokens 5, 6, 7 within 2 blocks. B (5 tokens to recompute,
        #         2 blocks) waits: only block 1 is free.
        [("A", 5, 1, [0, 2], True)],
        [("A", 6, 1, [0, 2], True)],
        [("A", 7, 1, [0, 2], True)],
        # step 5: A's token 8 needs a 3rd block: 1. A reaches 6 outputs -> finished, frees
        #         2, 1... tail first: 1, 2, 0 -> queue [1, 2, 0].
        [("A", 8, 1, [0, 2, 1], True)],
        # step 6: B resumes: recomputes its 4 prompt tokens + 1 output = 5 tokens, 2 blocks.
        [("B", 0, 5, [1, 2], True)],
        [("B", 5, 1, [1, 2], True)],
        [("B", 6, 1, [1, 2], True)],
        [("B", 7, 1, [1, 2], True)],
        # step 10: B's token 8 needs a 3rd block: 0. 6 outputs -> finished.
        [("B", 8, 1, [1, 2, 0], True)],
    ]
    outs = []
    for i, exp in enumerate(expected):
        outs.append(step(s))
        assert chunks(outs[-1]) == exp, f"step {i}"
    assert outs[1].preempted_request_ids == ("B",) and b.num_preemptions == 1
    assert outs[6].resumed_request_ids == ("B",) and outs[6].new_request_ids == ()
    assert outs[6].scheduled[0].token_ids == (200, 201, 202, 203, TOKEN)
    assert a.num_preemptions == 0 and a.output_token_ids == [TOKEN] * 6
    assert b.output_token_ids == [TOKEN] * 6 and b.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert a.prompt_token_ids == A_tokens
    assert s.kv_cache.num_free_blocks == 3 and not s.has_unfinished_requests()


@pytest.mark.parametrize("policy, victim", [("priority", "A"), ("fcfs", "B")])
def test_priority_preemption_picks_lowest_priority(policy, victim):
    # 3 blocks of 4. A: priority 1 (low), arrives first; B: priority 0 (high), arrives after
    # step 0. Both 4-token prompts, max_tokens 6. Prefix caching off.
    s = make(num_blocks=3, caching=False, policy=policy)
    a = add(s, "A", 4, 6, priority=1, arrival=0.0)
    assert chunks(step(s)) == [("A", 0, 4, [0], True)]  # step 0: A alone, block 0
    b = add(s, "B", 4, 6, priority=0, arrival=1.0)
    # step 1: A's token 4 -> 2nd block [0, 1]; B admitted with block [2]. Free: none.
    assert chunks(step(s)) == [("A", 4, 1, [0, 1], True), ("B", 0, 4, [2], True)]
    out = step(s)
    if policy == "priority":
        # step 2: A fits its token 5 in 2 blocks; B's token 4 needs a block, none free ->
        # victim = largest priority value = A, already scheduled this step: unscheduled,
        # its blocks freed tail first (queue 1, 0); B takes block 1.
        assert chunks(out) == [("B", 4, 1, [2, 1], True)]
        rest = [
            # steps 3-5: B decodes 5, 6, 7; A (6 tokens to recompute, 2 blocks) waits: 1 free.
            [("B", 5, 1, [2, 1], True)],
            [("B", 6, 1, [2, 1], True)],
            [("B", 7, 1, [2, 1], True)],
            # step 6: B's token 8 takes block 0; B finishes, frees 0, 1, 2 (tail first).
            [("B", 8, 1, [2, 1, 0], True)],
            # step 7: A resumes: 4 prompt + 2 outputs = 6 tokens -> 2 blocks [0, 1].
            [("A", 0, 6, [0, 1], True)],
            [("A", 6, 1, [0, 1], True)],
            [("A", 7, 1, [0, 1], True)],
            # step 10: token 8 takes block 2; A reaches 6 outputs.
            [("A", 8, 1, [0, 1, 2], True)],
        ]
        for i, exp in enumerate(rest, start=3):
            assert chunks(step(s)) == exp, f"step {i}"
        assert a.num_preemptions == 1 and b.num_preemptions == 0
    else:
        # FCFS: the victim is the newest arrival, B itself; A keeps running.
        assert chunks(out) == [("A", 5, 1, [0, 1], True)]
    assert out.preempted_request_ids == (victim,)
    while s.has_unfinished_requests():
        step(s)
    assert a.output_token_ids == b.output_token_ids == [TOKEN] * 6
    assert s.kv_cache.num_free_blocks == 3


def test_prefix_cache_hit_shares_blocks_copy_free():
    s = make(num_blocks=16, budget=64)
    a = add(s, "A", list(range(1, 11)), 3)  # tokens 1..10
    # step 0: A's 10 tokens -> blocks [0, 1, 2]; after it, full blocks 0 (1-4), 1 (5-8) cached.
    assert chunks(step(s)) == [("A", 0, 10, [0, 1, 2], True)]
    b = add(s, "B", [1, 2, 3, 4, 5, 6, 7, 8, 50, 51, 52], 3)
    out = step(s)
    # step 1: A decodes token 10 (11 tokens, 3 blocks). B hits blocks 0 and 1 (8 tokens,
    # cap (11 - 1) // 4 = 2 blocks), computes tokens 8..10 in one new block: 3.
    assert chunks(out) == [("A", 10, 1, [0, 1, 2], True), ("B", 8, 3, [0, 1, 3], True)]
    assert out.num_prefix_cache_hit_tokens == 8 and out.scheduled[1].num_cached_tokens == 8
    assert out.num_blocks_allocated == 1  # only block 3: the shared blocks were not copied
    assert b.num_cached_tokens == 8
    kv = s.kv_cache
    assert kv.blocks[0].ref_count == 2 and kv.blocks[1].ref_count == 2
    assert kv.blocks[0].owners == ("A", "B") and kv.blocks[3].owners == ("B",)
    # step 2: A decodes token 11 (12 tokens, 3 blocks) and finishes (3 outputs): only its
    # private block 2 is freed; B decodes token 11 (12 tokens, 3 blocks).
    assert chunks(step(s)) == [("A", 11, 1, [0, 1, 2], True), ("B", 11, 1, [0, 1, 3], True)]
    assert kv.blocks[0].ref_count == 1 and kv.blocks[0].owners == ("B",)
    # step 3: B's token 12 needs a 4th block: front of queue 4..15, 2 -> 4.
    assert chunks(step(s)) == [("B", 12, 1, [0, 1, 3, 4], True)]
    assert a.status is b.status is RequestStatus.FINISHED_LENGTH_CAPPED
    # queries: A 10 tokens + B 11 tokens; hits: 8.
    assert (kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits) == (21, 8)


def test_abort_during_prefill_and_while_waiting():
    s = make(budget=4)
    a = add(s, "A", 10, 2)
    b = add(s, "B", 2, 2)
    c = add(s, "C", 2, 2)
    # step 0: A [0, 4) in block 0; step 1: A [4, 8) in blocks 0, 1.
    run_and_compare(s, [[("A", 0, 4, [0], False)], [("A", 4, 4, [0, 1], False)]])
    s.abort_request("A")  # mid-prefill: 8 of 10 prompt tokens computed
    s.abort_request("C")  # still waiting
    s.check_invariants()
    assert a.status is c.status is RequestStatus.FINISHED_ABORTED
    assert s.kv_cache.block_table("A") == [] and [r.request_id for r in s.waiting] == ["B"]
    # A's blocks rejoin the queue tail first: 2..15, 1, 0.
    assert s.kv_cache.pool.free_queue.block_ids() == list(range(2, 16)) + [1, 0]
    out = step(s)
    assert out.finished_request_ids == ("A", "C")
    assert chunks(out) == [("B", 0, 2, [2], True)]
    # An abort between schedule() and update_from_output(): the chunk is dropped.
    out = s.schedule()
    s.abort_request("B")
    assert s.update_from_output(out, {"B": TOKEN}) == []
    assert b.output_token_ids == [TOKEN] and s.kv_cache.num_free_blocks == 16
    s.abort_request("B")  # already finished: ignored
    assert not s.has_unfinished_requests()


def test_shortest_prompt_first_and_custom_policy():
    s = make(budget=64, policy="spf")
    for rid, n in (("A", 9), ("B", 2), ("C", 5)):
        add(s, rid, n, 1)
    # spf order B (2), C (5), A (9): blocks B [0], C [1, 2], A [3, 4, 5].
    assert chunks(step(s)) == [("B", 0, 2, [0], True), ("C", 0, 5, [1, 2], True),
                               ("A", 0, 9, [3, 4, 5], True)]

    class LongestFirst(SchedulingPolicy):
        name = "lpf"

        def sort_key(self, request):
            return (-request.num_prompt_tokens, request.arrival_time)

    s = make(budget=64, policy=LongestFirst())
    for rid, n in (("A", 2), ("B", 9), ("C", 5)):
        add(s, rid, n, 1)
    assert [r.request_id for r in s.waiting] == ["B", "C", "A"]
    assert [c.request_id for c in step(s).scheduled] == ["B", "C", "A"]


# ------------------------------------------------------------------ stop conditions
def test_stop_conditions_without_text():
    s = make(max_model_len=8)
    eos = Request("eos", [1, 2], SamplingParams(max_tokens=5), eos_token_id=7)
    ign = Request("ign", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True), eos_token_id=7)
    mint = Request("min", [1, 2], SamplingParams(max_tokens=5, min_tokens=2), eos_token_id=7)
    stop = Request("stop", [1, 2], SamplingParams(max_tokens=5, stop_token_ids=[7]))
    mml = Request("mml", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=None))
    for r in (eos, ign, mint, stop, mml):
        s.add_request(r)
    out = step(s, sampled=7)  # every request samples 7
    assert eos.status is RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert stop.status is RequestStatus.FINISHED_STOPPED and stop.stop_reason == 7
    assert ign.status is RequestStatus.RUNNING and mint.status is RequestStatus.RUNNING
    assert mml.status is RequestStatus.RUNNING  # 7 tokens < max_model_len 8
    assert len(out.scheduled) == 5
    step(s, sampled=7)
    # ign: 2 outputs = max_tokens; min: 2 outputs >= min_tokens, eos now counts;
    # mml: 8 tokens = max_model_len.
    assert ign.status is mml.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert mint.status is RequestStatus.FINISHED_STOPPED
    assert [len(r.output_token_ids) for r in (eos, ign, mint, stop, mml)] == [1, 2, 2, 1, 2]
    assert not s.has_unfinished_requests() and s.kv_cache.num_free_blocks == 16


def test_finish_requests_for_stop_strings():
    s = make()
    a = add(s, "A", 3, 10)
    step(s)
    s.finish_requests(["A", "unknown"], RequestStatus.FINISHED_STOPPED)
    assert a.status is RequestStatus.FINISHED_STOPPED and s.running == []
    with pytest.raises(ValueError, match="finished status"):
        s.finish_requests("A", RequestStatus.RUNNING)


# ------------------------------------------------------------------ rejections
def test_add_request_rejects_what_can_never_fit():
    s = make(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len=32 allows at most 31 prompt tokens"):
        add(s, "long", 32, 1)
    with pytest.raises(ValueError, match="need 5 KV blocks of 4, but the KV cache has num_blocks=4"):
        add(s, "big", 17, 1)  # ceil(17/4) = 5 blocks > 4
    with pytest.raises(ValueError, match="needs up to 5 KV blocks of 4"):
        add(s, "grow", 10, 8)  # 10 + 8 - 1 = 17 tokens of K/V -> 5 blocks
    add(s, "ok", 10, 7)  # 16 tokens of K/V -> exactly 4 blocks
    with pytest.raises(ValueError, match="already in the scheduler"):
        add(s, "ok", 10, 7)
    with pytest.raises(ValueError, match="at least one token"):
        s.add_request(Request("empty", []))
    assert [r.request_id for r in s.waiting] == ["ok"]


def test_bad_config_and_policy_names():
    kv = KVCacheManager(4, 4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(kv, max_num_seqs=0, max_num_batched_tokens=8, max_model_len=16)
    with pytest.raises(ValueError, match="policy must be one of"):
        Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=8, max_model_len=16, policy="lifo")


def test_reprs_are_deterministic():
    def build():
        s = make(num_blocks=8, budget=6)
        add(s, "A", 10, 2, arrival=5.0)
        add(s, "B", 3, 2, arrival=6.0)
        return s, step(s)

    (s1, o1), (s2, o2) = build(), build()
    assert repr(s1) == repr(s2) and repr(o1) == repr(o2)
    assert repr(o1) == (
        "SchedulerOutput(step=0, tokens=6/6, new=['A'], blocks_allocated=2, blocks_evicted=0, "
        "prefix_hit_tokens=0, free_blocks=6, kv_usage=0.250,\n  A: prefill [0, 6) blocks=[0, 1])"
    )
    assert repr(s1) == (
        "Scheduler(policy=fcfs, step=1, max_num_seqs=8, max_num_batched_tokens=6, "
        "running=[A:6/10], waiting=[B:0/3], free_blocks=6/8)"
    )
    assert "<table>" in s1._repr_html_() and "<td>waiting</td>" in s1._repr_html_()
    assert "<td>prefill</td>" in o1._repr_html_()


def test_policy_victims_and_names():
    from workbench.core.sched.policies import FCFSPolicy, PriorityPolicy, ShortestPromptFirstPolicy, get_policy

    def r(rid, arrival, priority=0, n=4):
        return Request(rid, list(range(n)), priority=priority, arrival_time=arrival)

    # running order need not be arrival order: a resumed old request sits at the back.
    running = [r("new", 5.0, priority=0, n=2), r("mid", 3.0, priority=2, n=9), r("old", 1.0, priority=2, n=9)]
    assert FCFSPolicy().pick_victim(running).request_id == "new"  # newest arrival
    assert PriorityPolicy().pick_victim(running).request_id == "mid"  # priority 2, newer of the tie
    assert ShortestPromptFirstPolicy().pick_victim(running).request_id == "mid"  # longest, newer
    assert isinstance(get_policy("PRIORITY"), PriorityPolicy)
    custom = FCFSPolicy()
    assert get_policy(custom) is custom
