"""The scheduler's decode short path (``Scheduler._decode_chunk``) against the general path.

A plain decode -- one generated token left to compute, no drafts, no output placeholder, a slot
for it in the block table already -- gets its ScheduledRequest without ``_num_new_tokens``,
``allocate_slots`` and ``_chunk``. The hand-worked cases below say which requests take it
(block_size 4, blocks handed out 0, 1, 2, ...; the fake runner samples token 9); the seeded
workloads run two schedulers side by side, one with the short path switched off, and require
every step's output and every event to be equal.
"""

import functools
import random

import pytest

from workbench.core.kv_cache_manager import KVCacheManager
from workbench.core.sched.async_scheduler import PLACEHOLDER_TOKEN_ID, AsyncScheduler
from workbench.core.sched.output import ScheduledRequest
from workbench.core.sched.scheduler import Scheduler
from workbench.lora.request import LoRARequest
from workbench.request import Request
from workbench.sampling_params import SamplingParams

TOKEN = 9
ADAPTER = LoRARequest("ad", 1, "/adapters/ad")


def make(cls=Scheduler, num_blocks=16, budget=64, max_num_seqs=8, max_loras=None, events=False, policy="fcfs"):
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=True, record_events=events)
    return cls(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=64,
               max_loras=max_loras, record_events=events, policy=policy)


def add(s, rid, prompt_len, max_tokens=8, lora=None):
    r = Request(rid, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                lora_request=lora)
    s.add_request(r)
    return r


def step(s):
    out = s.schedule()
    s.check_invariants(out)
    s.update_from_output(out, {c.request_id: TOKEN for c in out.scheduled if c.samples})
    s.check_invariants()
    return out


def test_block_ids_with_room_says_whether_the_table_already_holds_the_slots():
    kv = KVCacheManager(8, 4)
    r = Request("a", list(range(6)))
    assert kv.block_ids_with_room("a", 1) is None  # no table yet
    kv.allocate_slots(r, 6)  # ceil(6 / 4) = 2 blocks: 8 slots
    assert kv.block_ids_with_room("a", 8) == (0, 1)
    assert kv.block_ids_with_room("a", 9) is None  # a ninth token needs a third block


def test_a_decode_takes_the_short_path_until_its_tail_block_is_full():
    s = make()
    a = add(s, "A", 3)
    # step 0: the 3-token prompt, one block [0], samples: outputs [9], 4 known tokens.
    assert step(s).scheduled == (ScheduledRequest("A", 0, 3, (100, 101, 102), (0,), True, True),)
    # step 1: token 3 (the first output) has slot 3 of block 0: the short path.
    expected = ScheduledRequest("A", 3, 1, (TOKEN,), (0,), False, True)
    assert s._decode_chunk(a) == expected
    assert step(s).scheduled == (expected,)
    # step 2: token 4 needs a fifth slot: no short path; the general path allocates block 1.
    assert s._decode_chunk(a) is None
    assert step(s).scheduled == (ScheduledRequest("A", 4, 1, (TOKEN,), (0, 1), False, True),)
    assert s._decode_chunk(a) == ScheduledRequest("A", 5, 1, (TOKEN,), (0, 1), False, True)


def test_drafts_a_prompt_token_and_placeholders_take_the_general_path():
    s = make(budget=2)
    a = add(s, "A", 3)
    assert s._decode_chunk(a) is None  # waiting: no output yet
    step(s)  # A: 2 of its 3 prompt tokens (budget 2)
    assert s._decode_chunk(a) is None  # one prompt token left: a prefill chunk
    step(s)  # its last prompt token: samples, outputs [9]
    s.update_draft_token_ids({"A": [7, 8]})
    assert s._decode_chunk(a) is None  # drafts to verify
    # budget 2: the known token and one draft; 6 slots -> blocks [0, 1].
    assert step(s).scheduled == (ScheduledRequest("A", 3, 2, (TOKEN, 7), (0, 1), False, True, 0, None, (7,)),)
    r = Request("B", [1, 2, 3], output_token_ids=[5], num_computed_tokens=3, num_output_placeholders=1)
    assert s._decode_chunk(r) is None  # a token in flight (async scheduling)


def test_the_short_path_carries_the_adapter():
    s = make(max_loras=1)
    add(s, "A", 5, lora=ADAPTER)
    step(s)  # 5 prompt tokens -> blocks [0, 1], outputs [9]
    assert step(s).scheduled == (ScheduledRequest("A", 5, 1, (TOKEN,), (0, 1), False, True, 0, "ad"),)


def test_async_decodes_keep_their_placeholder_chunks():
    s = make(AsyncScheduler)
    a = add(s, "A", 3)
    s.schedule()  # the prompt, optimistically computed: one placeholder in flight
    assert s._decode_chunk(a) is None
    out = s.schedule()  # step 1 before step 0's token is known
    assert out.scheduled == (ScheduledRequest("A", 3, 1, (PLACEHOLDER_TOKEN_ID,), (0,), False, True),)


@functools.lru_cache(maxsize=None)
def run(seed: int, short_path: bool) -> list:
    """A seeded workload on a small pool (preemptions), with drafts, adapters and prefix
    sharing; every step's output and events."""
    rng = random.Random(seed)
    s = make(num_blocks=rng.randint(8, 11), budget=rng.randint(4, 24), max_num_seqs=rng.randint(3, 6),
             max_loras=2, events=True, policy=rng.choice(["fcfs", "priority"]))
    if not short_path:
        s._decode_chunk = lambda request: None
    adapters = [None, LoRARequest("x", 1, "/x"), LoRARequest("y", 2, "/y")]
    shared = list(range(200, 208))
    steps, n = [], 0
    for i in range(200):
        if n < 16 and rng.random() < 0.5:
            prompt = shared[:rng.randint(0, 8)] + [rng.randint(0, 50) for _ in range(rng.randint(1, 10))]
            s.add_request(Request(f"r{n}", prompt, SamplingParams(max_tokens=rng.randint(1, 14), ignore_eos=True),
                                  lora_request=rng.choice(adapters), arrival_time=float(i),
                                  priority=rng.randint(0, 3)))
            n += 1
        if rng.random() < 0.3:  # drafts for some running requests
            s.update_draft_token_ids({r.request_id: [rng.randint(0, 50)] * rng.randint(1, 3)
                                      for r in s.running if rng.random() < 0.5})
        out = s.schedule()
        s.check_invariants(out)
        s.update_from_output(out, {c.request_id: rng.randint(0, 50) for c in out.scheduled if c.samples})
        steps.append((out, s.take_events(), s.kv_cache.take_events()))
        if n == 16 and not s.has_unfinished_requests():
            break
    return steps


@pytest.mark.parametrize("seed", range(6))
def test_the_short_path_schedules_exactly_what_the_general_path_does(seed):
    with_short, without = run(seed, True), run(seed, False)
    assert any(out.preempted_request_ids for out, _, _ in with_short)
    assert any(c.spec_token_ids for out, _, _ in with_short for c in out.scheduled)
    assert any(c.lora_name for out, _, _ in with_short for c in out.scheduled)
    assert with_short == without


def test_a_victim_scheduled_earlier_in_its_step_loses_its_short_path_chunk():
    # Seed 2 (priority policy) preempts requests the running pass had already scheduled.
    with_short, without = run(2, True), run(2, False)
    assert any(p.unscheduled for out, _, _ in with_short for p in out.explanation.preemptions)
    assert with_short == without
