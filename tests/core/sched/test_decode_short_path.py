"""The scheduler's decode short path against its general path.

A plain decode -- one generated token left to compute, no drafts, no output placeholder, a slot
for it in the block table already -- gets its ScheduledRequest in the running pass without
``_num_new_tokens``, ``allocate_slots`` and ``_chunk``. The hand-worked cases below give the
chunks a request gets on either side of that line (block_size 4, blocks handed out 0, 1, 2,
...; the fake runner samples token 9); the seeded workloads run two schedulers side by side, one
whose KV manager shows it no table (so every request takes the general path), and require
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


class BlindKV(KVCacheManager):
    """A KV manager that shows the scheduler no table, so no request takes the short path."""

    @property
    def block_ids_by_request(self):
        return {}


def make(cls=Scheduler, num_blocks=16, budget=64, max_num_seqs=8, max_loras=None, events=False,
         policy="fcfs", kv_cls=KVCacheManager):
    kv = kv_cls(num_blocks, 4, enable_prefix_caching=True, record_events=events)
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


def test_block_ids_by_request_is_the_tables_as_ids():
    kv = KVCacheManager(8, 4)
    r = Request("a", list(range(6)))
    assert "a" not in kv.block_ids_by_request  # no table yet
    kv.allocate_slots(r, 6)  # ceil(6 / 4) = 2 blocks: 8 slots
    assert kv.block_ids_by_request["a"] == kv.block_ids("a") == (0, 1)
    kv.free(r)
    assert "a" not in kv.block_ids_by_request


@pytest.mark.parametrize("kv_cls", [KVCacheManager, BlindKV])
def test_a_decode_at_a_block_boundary_takes_the_general_path_for_one_step(kv_cls):
    s = make(kv_cls=kv_cls)
    add(s, "A", 3)
    expected = [
        # step 0: the 3-token prompt, one block [0], samples: outputs [9], 4 known tokens.
        ScheduledRequest("A", 0, 3, (100, 101, 102), (0,), True, True),
        # step 1: token 3 (the first output) has slot 3 of block 0: the short path.
        ScheduledRequest("A", 3, 1, (TOKEN,), (0,), False, True),
        # step 2: token 4 needs a fifth slot: the general path allocates block 1.
        ScheduledRequest("A", 4, 1, (TOKEN,), (0, 1), False, True),
        # step 3: token 5 has slot 5 of block 1: the short path again.
        ScheduledRequest("A", 5, 1, (TOKEN,), (0, 1), False, True),
    ]
    assert [step(s).scheduled for _ in expected] == [(c,) for c in expected]


def test_a_decode_with_drafts_takes_the_general_path():
    s = make(budget=2)
    add(s, "A", 3)
    step(s)  # A: 2 of its 3 prompt tokens (budget 2)
    step(s)  # its last prompt token: samples, outputs [9]
    s.update_draft_token_ids({"A": [7, 8]})
    # budget 2: the known token and one draft at positions 3, 4 -> 5 slots, blocks [0, 1].
    assert step(s).scheduled == (ScheduledRequest("A", 3, 2, (TOKEN, 7), (0, 1), False, True, 0, None, (7,)),)
    # The draft was rejected (the runner's 9 came in its place) and block 1, which held only
    # it, went back to the free queue's end: token 4 needs a block again, the front one, 2.
    assert step(s).scheduled == (ScheduledRequest("A", 4, 1, (TOKEN,), (0, 2), False, True),)
    assert step(s).scheduled == (ScheduledRequest("A", 5, 1, (TOKEN,), (0, 2), False, True),)  # short path


def test_the_short_path_carries_the_adapter():
    s = make(max_loras=1)
    add(s, "A", 5, lora=ADAPTER)
    step(s)  # 5 prompt tokens -> blocks [0, 1], outputs [9]
    assert step(s).scheduled == (ScheduledRequest("A", 5, 1, (TOKEN,), (0, 1), False, True, 0, "ad"),)


def test_async_decodes_keep_their_placeholder_chunks():
    s = make(AsyncScheduler)
    add(s, "A", 3)
    s.schedule()  # the prompt, optimistically computed: one placeholder in flight
    out = s.schedule()  # step 1 before step 0's token is known
    assert out.scheduled == (ScheduledRequest("A", 3, 1, (PLACEHOLDER_TOKEN_ID,), (0,), False, True),)


@functools.lru_cache(maxsize=None)
def run(seed: int, short_path: bool) -> list:
    """A seeded workload on a small pool (preemptions), with drafts, adapters and prefix
    sharing; every step's output and events."""
    rng = random.Random(seed)
    s = make(num_blocks=rng.randint(8, 11), budget=rng.randint(4, 24), max_num_seqs=rng.randint(3, 6),
             max_loras=2, events=True, policy=rng.choice(["fcfs", "priority"]),
             kv_cls=KVCacheManager if short_path else BlindKV)
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


def test_a_victim_scheduled_earlier_in_its_step_loses_its_chunk():
    # Seed 2 (priority policy) preempts requests the running pass had already scheduled.
    with_short, without = run(2, True), run(2, False)
    assert any(p.unscheduled for out, _, _ in with_short for p in out.explanation.preemptions)
    assert with_short == without
