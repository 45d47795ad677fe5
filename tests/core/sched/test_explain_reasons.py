"""Each reason, preemption and prefix-lookup cause from a hand-built workload, asserted exactly.

Conventions as tests/core/sched/test_scheduler_schedules.py: block_size 4; a fresh pool hands
out blocks 0, 1, 2, ... in order; a freed request's blocks rejoin the back of the free queue
tail block first; the fake runner samples token 9; prompts of different requests share no token.
"""

from workbench.core.kv_cache_manager import KVCacheManager
from workbench.core.sched.explain import (
    BehindInOrder,
    ChunkedPrefillLimit,
    GrammarCompiling,
    KVBlocksShort,
    MaxLorasReached,
    MaxNumSeqsReached,
    MissCause,
    PreemptionExplanation,
    PreemptionInStep,
    Preempted,
    PrefixLookup,
    TokenBudgetSpent,
)
from workbench.core.sched.scheduler import Scheduler
from workbench.lora.request import LoRARequest
from workbench.request import Request, RequestStatus
from workbench.sampling_params import SamplingParams


def make(num_blocks=16, budget=64, max_num_seqs=8, chunked=True, policy="fcfs", max_loras=None):
    kv = KVCacheManager(num_blocks, 4)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=64,
                     enable_chunked_prefill=chunked, policy=policy, max_loras=max_loras)


def add(s, rid, prompt, max_tokens=8, **kw):
    if isinstance(prompt, int):
        base = 100 * (ord(rid[0]) - ord("A") + 1)
        prompt = list(range(base, base + prompt))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            **{k: kw.pop(k) for k in ("prompt_logprobs",) if k in kw})
    r = Request(rid, prompt, params, **kw)
    s.add_request(r)
    return r


def step(s):
    out = s.schedule()
    s.update_from_output(out, {c.request_id: 9 for c in out.scheduled if c.samples})
    return out.explanation


def test_budget_chunk_kv_short_preemption_and_blocked_queue():
    # 6 blocks, budget 16. A, B: 10-token prompts; C: 3 tokens.
    s = make(num_blocks=6, budget=16)
    add(s, "A", 10), add(s, "B", 10), add(s, "C", 3)
    why = step(s)  # step 0: A 10 (blocks 0-2), B 6 of 10 (blocks 3, 4): budget spent; C not reached
    spent = TokenBudgetSpent(16, (("A", 10), ("B", 6)))
    assert dict(why.reasons) == {"B": ChunkedPrefillLimit(6, 10, 6), "C": spent}
    assert why.prefix_lookups == (PrefixLookup("A", 0, 10, MissCause.NEVER_COMPUTED, 0),
                                  PrefixLookup("B", 0, 10, MissCause.NEVER_COMPUTED, 0))
    # step 1: A decodes (11 tokens fit its 3 blocks), B's last 4 take block 5: 0 free;
    # C (1 block) is short.
    assert dict(step(s).reasons) == {"C": KVBlocksShort(1, 0, 0, 0)}
    assert dict(step(s).reasons) == {"C": KVBlocksShort(1, 0, 0, 0)}  # step 2: both decode in place
    # step 3: A's 13th token needs a 4th block; the victim (newest arrival) is B, which held
    # 3 blocks and 11 computed tokens (2 full blocks cached: 11 - 8 = 3 to recompute);
    # a step that preempts admits nobody.
    why = step(s)
    assert why.preemptions == (PreemptionExplanation("B", "A", "newest arrival", 3, 11, 2, 3, False),)
    assert dict(why.reasons) == {"B": Preempted("A"), "C": PreemptionInStep(("B",))}
    # step 4: B (12 tokens) hits its 2 cached free blocks + 1 new = 3 > 2 free; C waits behind it.
    assert dict(step(s).reasons) == {"B": KVBlocksShort(3, 2, 2, 2), "C": BehindInOrder("B")}


def test_max_num_seqs():
    s = make(max_num_seqs=1)
    add(s, "A", 4), add(s, "B", 4)
    assert dict(step(s).reasons) == {"B": MaxNumSeqsReached(1, 1)}


def test_whole_prompt_required_without_chunked_prefill():
    s = make(budget=16, chunked=False)
    add(s, "A", 10), add(s, "B", 10), add(s, "C", 2)
    # A takes 10; B needs its 10 in one step, 6 are left; C may not overtake it.
    assert dict(step(s).reasons) == {"B": ChunkedPrefillLimit(0, 10, 6, whole_prompt_required=True),
                                     "C": BehindInOrder("B")}


def test_grammar_compiling_and_max_loras_keep_their_place():
    s = make(max_loras=1)
    x, y = LoRARequest("x", 1, "/x"), LoRARequest("y", 2, "/y")
    fsm = Request("F", list(range(600, 604)), SamplingParams(max_tokens=2, ignore_eos=True))
    fsm.status = RequestStatus.WAITING_FOR_FSM  # no grammar manager: it stays compiling
    s.add_request(fsm)
    add(s, "X", 4, lora_request=x), add(s, "Y", 4, lora_request=y), add(s, "Z", 4)
    assert dict(step(s).reasons) == {"F": GrammarCompiling(), "Y": MaxLorasReached("y", 1, ("x",))}


def test_running_requests_behind_one_that_preempted_itself():
    # priority policy: the victim is the largest priority value. 4 blocks. Step 0: A
    # (priority 5) prefills 7 tokens (blocks 0, 1); B (priority 0) arrives and at step 1 takes
    # blocks 2, 3 while A decodes its 8th token in place. Step 2: A's 9th token needs a third
    # block; A itself is the victim (2 blocks, 8 computed tokens, both blocks full and cached:
    # nothing to recompute if they survive); the running pass stops, B is left out behind it.
    s = make(num_blocks=4, policy="priority")
    add(s, "A", 7, priority=5)
    step(s)
    add(s, "B", 7, priority=0)
    step(s)
    why = step(s)
    assert why.preemptions == (
        PreemptionExplanation("A", "A", "largest priority value, then newest", 2, 8, 2, 0, False),)
    assert dict(why.reasons) == {"A": Preempted("A"), "B": BehindInOrder("A", "running")}


def test_prefix_miss_causes():
    # 4 blocks. A: 9 tokens (blocks 0-2), max_tokens 1: done in step 0; blocks 0, 1 cached,
    # the partial block 2 not. Free queue after: [3, 2, 1, 0].
    s = make(num_blocks=4)
    prompt = list(range(500, 509))
    add(s, "A", prompt, max_tokens=1)
    step(s)
    add(s, "B", 9, max_tokens=1)  # step 1: blocks 3, 2, 1 -- block 1's hash (A's 2nd) evicted for B
    step(s)
    add(s, "C", prompt, max_tokens=1)  # step 2: block 0 still cached, block 1 gone
    assert step(s).prefix_lookups == (PrefixLookup("C", 1, 9, MissCause.EVICTED, 1,
                                                   evicted_at_step=1, evicted_for="B"),)
    add(s, "D", prompt, max_tokens=1, cache_salt="s")  # same tokens, another salt
    assert step(s).prefix_lookups == (PrefixLookup("D", 0, 9, MissCause.OTHER_CACHE_SALT, 0),)
    add(s, "E", prompt[:8], max_tokens=1)  # C cached both full blocks; the last one holds the last token
    assert step(s).prefix_lookups == (PrefixLookup("E", 1, 8, MissCause.LAST_TOKEN, 1),)
    add(s, "F", prompt, max_tokens=1)  # all full blocks hit; block 2 is partial
    assert step(s).prefix_lookups == (PrefixLookup("F", 2, 9, MissCause.PARTIAL_BLOCK, 2),)
    add(s, "G", prompt, max_tokens=1, prompt_logprobs=1)
    assert step(s).prefix_lookups == (PrefixLookup("G", 0, 9, MissCause.PROMPT_LOGPROBS, 0),)
    add(s, "H", prompt, max_tokens=1, lora_request=LoRARequest("x", 1, "/x"))
    assert step(s).prefix_lookups == (PrefixLookup("H", 0, 9, MissCause.OTHER_LORA, 0),)


def test_a_long_queue_keeps_its_first_requests_and_shares_the_rest():
    """Past EXPLAINED_WAITING in the queue's order a request has no entry of its own: it shares
    the step's waiting_reason (a record stays small under overload), and explain() reads it back."""
    from workbench.core.sched.explain import EXPLAINED_WAITING
    from workbench.engine.why import explain_request

    s = make(num_blocks=64, budget=8, max_num_seqs=1)
    n = EXPLAINED_WAITING + 10
    ids = [f"r{i:03d}" for i in range(n)]
    for i, rid in enumerate(ids):
        s.add_request(Request(rid, list(range(1000 * (i + 1), 1000 * (i + 1) + 4)),
                              SamplingParams(max_tokens=2, ignore_eos=True)))
    why = step(s)  # r000 admitted; max_num_seqs stops the pass for everyone behind it
    seats = MaxNumSeqsReached(1, 1, 0)
    assert why.waiting_reason == seats
    assert dict(why.reasons) == {rid: seats for rid in ids[1:EXPLAINED_WAITING + 1]}

    class Record:  # what explain() reads of a StepRecord
        step, scheduler_output, finished_request_ids = 0, None, ()
        request_events = ()

    record = Record()
    record.scheduler_output = type("SO", (), {"explanation": why, "scheduled": (), "preempted_request_ids": ()})()
    record.request_events = (type("E", (), {"kind": "arrived", "request_id": ids[-1]})(),)
    (row,) = explain_request([record], ids[-1]).rows
    assert (row["state"], row["reason"]) == ("waiting", "max_num_seqs")
