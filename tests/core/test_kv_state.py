"""The recording layer at the scheduler level (fake runner, no model): KV block events,
KVState rebuilt from them, request events and the metrics folded from them.

A hand-worked schedule fixes the expectations of one small run; a property test checks,
over random workloads with preemption, prefix hits, aborts and cache resets, that the pool
rebuilt from a (bounded) step history equals a snapshot taken live after every step.
"""

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from workbench.core.kv_cache_manager import KVCacheManager
from workbench.core.kv_events import (
    BlockAllocated,
    BlockFreed,
    BlockRemoved,
    BlockStored,
    BlockWritten,
)
from workbench.core.block_pool import KVCacheBlock
from workbench.core.kv_state import BLOCK_STATES, BlockState, KVReplay, KVState, block_state, never_used_blocks
from workbench.core.kv_cache_utils import hash_block_tokens
from workbench.core.request_events import RequestPreempted, RequestPrefixHit, RequestResumed
from workbench.core.sched.scheduler import Scheduler
from workbench.engine.history import StepHistory, StepRecord
from workbench.request import Request
from workbench.metrics.request_tracker import RequestTracker
from workbench.metrics.stats import SchedulerStats
from workbench.sampling_params import SamplingParams


class Harness:
    """Drives a Scheduler with a fake runner (output k of any request is token 90 + k) and
    records each step as the engine does: StepRecords with the events since the previous one,
    a history started from a snapshot, and a live snapshot after every step."""

    def __init__(self, num_blocks, block_size, *, budget=8, max_num_seqs=3, caching=True,
                 chunked=True, policy="fcfs", max_history=10_000, max_model_len=64, capture=False):
        self.kv = KVCacheManager(num_blocks, block_size, caching, record_events=True)
        self.s = Scheduler(self.kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                           max_model_len=max_model_len, enable_chunked_prefill=chunked, policy=policy,
                           record_events=True)
        self.history = StepHistory(max_history, initial_kv_state=self.kv.snapshot())
        self.tracker = RequestTracker()
        self.live: dict[int, KVState] = {}
        self.capture = capture  # append with the KV cache, as the engine does (live checkpoints)

    def add(self, rid, prompt, max_tokens, arrival, priority=0):
        self.s.add_request(Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                   priority=priority, arrival_time=float(arrival)))

    def step(self, abort_mid_step=()):
        out = self.s.schedule()
        for rid in abort_mid_step:
            self.s.abort_request(rid)
        sampled = {c.request_id: 90 + self.s.requests[c.request_id].num_output_tokens
                   for c in out.scheduled if c.samples and c.request_id in self.s.requests}
        finished = [r.request_id for r in self.s.update_from_output(out, sampled) if r.is_finished]
        record = StepRecord(
            step=out.step, scheduler_output=out, batch=None, sampled_token_ids=sampled,
            finished_request_ids=tuple(finished),
            scheduler_stats=SchedulerStats(
                num_running_reqs=len(self.s.running), num_waiting_reqs=len(self.s.waiting),
                num_free_blocks=self.kv.num_free_blocks, kv_cache_usage=self.kv.usage),
            kv_events=self.kv.take_events(), request_events=self.s.take_events(),
        )
        self.history.append(record, self.kv if self.capture else None)
        self.tracker.consume(record.request_events)
        self.live[record.step] = self.kv.snapshot()
        return record


def h(parent, *tokens):
    return hash_block_tokens(parent, tokens)


def test_hand_worked_schedule_blocks_events_and_metrics():
    """block_size 2, 5 blocks, budget 8, 3 seqs, FCFS, prefix caching, chunked prefill.
    A=[1,2,3] and B=[1,2,5] arrive at step 0, C=[6]*5 at step 1; A, B want 4 outputs, C 2.

    step 0: A takes blocks 0,1 and B 2,3 (free queue [4]); both prefill and sample. Block 0
            (A's [1,2]) enters the cache; B's block 2 holds the same tokens but the hash is
            taken, so it is only written.
    step 1: A, B decode inside their tail blocks; C needs 3 blocks, 1 is free: it waits.
            A's block 1 [3,90] and B's block 3 [5,90] (parent hash: [1,2]'s) are cached.
    step 2: A needs a block for token 5 and takes block 4; B needs one too, none is free:
            FCFS preempts the newest, B itself. B's blocks go back tail first: queue [3,2]
            (3 keeps its hash; 2 forgets its tokens). No admission in a step that preempted.
    step 3: B resumes first (front of the queue): prefix hits block 0 (shared with A) and
            block 3 (taken back from the free queue) = 4 tokens, and a new block 2 for the
            5th. C still waits (no free block). A samples its 4th token and finishes: frees
            4, 1 (both cached), and drops its reference on 0: queue [4, 1].
    step 4: B decodes, finishes (4 outputs): blocks 2, 3, 0 freed: queue [4, 1, 2, 3, 0].
    step 5: C takes the front three 4, 1, 2, evicting their cached hashes: queue [3, 0].
    step 6: C samples its 2nd token and finishes: queue [3, 0, 2, 1, 4].
    """
    t = Harness(5, 2, budget=8, max_num_seqs=3)
    t.add("A", [1, 2, 3], 4, arrival=0)
    t.add("B", [1, 2, 5], 4, arrival=1)
    r0 = t.step()
    t.add("C", [6] * 5, 2, arrival=2)
    for _ in range(6):
        t.step()
    assert not t.s.has_unfinished_requests()

    expected = {  # step: (tables, free queue)
        0: ({"A": (0, 1), "B": (2, 3)}, (4,)),
        1: ({"A": (0, 1), "B": (2, 3)}, (4,)),
        2: ({"A": (0, 1, 4)}, (3, 2)),
        3: ({"B": (0, 3, 2)}, (4, 1)),
        4: ({}, (4, 1, 2, 3, 0)),
        5: ({"C": (4, 1, 2)}, (3, 0)),
        6: ({}, (3, 0, 2, 1, 4)),
    }
    for step, (tables, free) in expected.items():
        state = t.history.kv_state(step)
        assert state == t.live[step], step
        assert dict(state.tables) == tables, step
        assert state.free_queue == free, step
        for rid, ids in tables.items():
            assert state.block_table(rid) == list(ids)
            assert all(rid in state.blocks[b].owners for b in ids)

    h12 = h(None, 1, 2)
    assert r0.kv_events == (
        BlockAllocated(0, "A"), BlockAllocated(1, "A"), BlockAllocated(2, "B"), BlockAllocated(3, "B"),
        BlockStored((0,), (h12,), None, (1, 2), 2), BlockWritten(1, (3,)),
        BlockWritten(2, (1, 2)), BlockWritten(3, (5,)),
    )
    assert BlockStored((3,), (h(h12, 5, 90),), h12, (5, 90), 2) in t.history.record(1).kv_events
    assert t.history.record(2).kv_events[-3:] == (
        BlockFreed(3, "B"), BlockFreed(2, "B"), BlockWritten(4, (91,)),
    )
    s2 = t.history.kv_state(2)
    assert s2.blocks[3].block_hash == h(h12, 5, 90) and s2.blocks[3].state == "cached"
    assert s2.blocks[2].token_ids == () and s2.blocks[2].state == "free"
    s3 = t.history.kv_state(3)
    assert s3.blocks[0].owners == ("B",) and s3.blocks[0].ref_count == 1
    a1, b1 = h(h12, 3, 90), h(h12, 5, 90)
    a2, b2 = h(a1, 91, 92), h(b1, 91, 92)  # A's block 4 and B's block 2, full after 4 outputs
    assert t.history.record(5).kv_events[:3] == (  # one BlockRemoved per evicted block
        BlockRemoved((a2,), (4,)), BlockRemoved((a1,), (1,)), BlockRemoved((b2,), (2,)),
    )

    log = t.history.request_log("B")
    assert RequestPreempted("B", 2, block_ids=(2, 3), num_computed_tokens=4) in log
    assert RequestResumed("B", 3, num_cached_tokens=4) in log
    assert RequestPrefixHit("B", 3, num_tokens=4, block_ids=(0, 3)) in log
    assert [e.kind for e in t.history.request_log("C")] == [
        "arrived", "scheduled", "first_token", "scheduled", "finished"]

    rows = {r["request_id"]: r for r in t.tracker.rows()}
    hand = {  # arrival, first scheduled, first token, finished step; preemptions, recomputed, cached
        "A": (0, 0, 0, 3, 0, 0, 0),
        "B": (0, 0, 0, 4, 1, 0, 0),  # its 4 lost tokens all came back as prefix hits
        "C": (1, 5, 5, 6, 0, 0, 0),
    }
    for rid, (arr, sched, tok, fin, pre, rec, cached) in hand.items():
        row = rows[rid]
        assert (row["arrival_step"], row["first_scheduled_step"], row["first_token_step"],
                row["finished_step"]) == (arr, sched, tok, fin), rid
        assert (row["num_preemptions"], row["num_recomputed_tokens"], row["num_cached_tokens"]) == (pre, rec, cached)
        assert row["ttft_steps"] == tok - arr + 1 and row["e2e_steps"] == fin - arr + 1
        assert row["finish_reason"] == "length"
    assert rows["A"]["num_output_tokens"] == 4 and rows["C"]["num_output_tokens"] == 2
    assert rows["A"]["tpot_steps"] == (3 - 0) / 3 and rows["C"]["tpot_steps"] == 1.0


def test_recomputed_tokens_when_the_cache_lost_the_blocks():
    """Caching off: B (preempted with 4 computed tokens) finds no prefix when it resumes
    and computes all 4 again."""
    t = Harness(5, 2, budget=8, max_num_seqs=3, caching=False)
    t.add("A", [1, 2, 3], 4, arrival=0)
    t.add("B", [1, 2, 5], 4, arrival=1)
    while t.s.has_unfinished_requests():
        t.step()
    b = {r["request_id"]: r for r in t.tracker.rows()}["B"]
    assert b["num_preemptions"] == 1 and b["num_recomputed_tokens"] == 4
    for step, live in t.live.items():
        assert t.history.kv_state(step) == live


def test_bounded_history_still_replays_and_names_missing_steps():
    t = Harness(5, 2, max_history=2)
    t.add("A", [1, 2, 3], 4, arrival=0)
    t.add("B", [1, 2, 5], 4, arrival=1)
    while t.s.has_unfinished_requests():
        t.step()
    last = t.history[-1].step
    assert last >= 3 and list(t.history.steps) == [last - 1, last]
    for step in t.history.steps:
        assert t.history.kv_state(step) == t.live[step]
    with pytest.raises(IndexError, match=r"step 0 is not recorded \(steps kept: \["):
        t.history.kv_state(0)
    t.history.clear()  # the dropped records' events are folded into the base state
    assert len(t.history) == 0 and t.history.kv_state() == t.live[last]
    t.add("C", [1, 2, 7], 2, arrival=2)
    record = t.step()
    assert record.step == last + 1 and t.history.kv_state(last + 1) == t.live[last + 1]
    with pytest.raises(ValueError, match="cannot follow step"):
        t.history.append(record)


def test_a_history_appended_with_its_kv_cache_drops_records_without_replaying_them(monkeypatch):
    """As the engine appends (with its KV cache), a full history turns a live snapshot into
    a checkpoint now and then and rebases on it when that record goes: stepping replays no
    dropped record's events, and every kept step -- the oldest, asked for while dropped
    events wait for the next checkpoint, included -- equals the live pool."""
    t = Harness(12, 2, budget=8, max_num_seqs=3, max_history=8, capture=True)
    run, replayed = KVReplay.run, []

    def counted(replay, events):
        replayed.append(events)
        return run(replay, events)

    for i in range(12):
        t.add(f"r{i}", [i % 3, 1, 2, 3, i], 6, arrival=i)
    pending_seen = 0
    while t.s.has_unfinished_requests():
        monkeypatch.setattr(KVReplay, "run", counted)
        record = t.step()
        monkeypatch.setattr(KVReplay, "run", run)  # kv_state() below replays from a checkpoint
        if t.history._dropped:
            pending_seen += 1
            oldest = t.history.steps[0]
            assert t.history.kv_state(oldest) == t.live[oldest]
    assert record.step > 3 * 8 and pending_seen and not replayed
    for step in t.history.steps:
        assert t.history.kv_state(step) == t.live[step]
    t.history.clear()
    assert t.history.kv_state() == t.live[record.step]


def test_block_state_classifies_live_and_recorded_blocks_alike():
    live = KVCacheBlock(7)
    assert block_state(live) == "free" and block_state(live, never_used=True) == "never used"
    live.block_hash = b"h"
    assert block_state(live) == "cached" == block_state(live, never_used=True)  # a hash was stored
    for ref_count, expected in ((1, "used"), (2, "shared"), (3, "shared")):
        live.ref_count = ref_count
        assert block_state(live) == expected == BlockState(7, ref_count, b"h", (), ("a",) * ref_count).state
    assert set(KVState.empty(2, 2).counts()) | {"never used"} == set(BLOCK_STATES)


def test_never_used_blocks_is_the_untouched_front_run_of_the_free_queue():
    assert never_used_blocks([3, 4, 5], 6) == {3, 4, 5}
    assert never_used_blocks((4, 5, 0, 2), 6) == {4, 5}  # 0 and 2 were freed after use
    assert never_used_blocks([0, 1], 6) == set()  # block 5 was handed out once
    assert never_used_blocks([], 6) == set()


def test_events_that_do_not_fit_are_refused_by_name():
    state = KVState.empty(3, 2)
    with pytest.raises(ValueError, match="BlockFreed.*does not fit"):
        state.apply([BlockFreed(1, "x")])
    cached = state.apply([BlockAllocated(0, "x"), BlockStored((0,), (b"h",), None, (1, 2), 2)])
    with pytest.raises(ValueError, match="BlockRemoved.*does not fit"):  # one event per block
        cached.apply([BlockRemoved((b"h", b"g"), (0, 1))])
    with pytest.raises(ValueError, match="no starting KV snapshot"):
        StepHistory(5).kv_state()


# ------------------------------------------------------------------ property
request_st = st.tuples(
    st.integers(0, 6),  # arrival step
    st.integers(0, 12),  # length of a shared prefix
    st.lists(st.integers(0, 3), max_size=6),  # private suffix
    st.integers(1, 8),  # max_tokens
    st.integers(0, 2),  # priority
    st.one_of(st.none(), st.tuples(st.integers(0, 12), st.booleans())),  # abort (step, mid-step)
)
config_st = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4]),
    "num_blocks": st.integers(6, 16),
    "budget": st.integers(4, 24),
    "max_num_seqs": st.integers(2, 5),
    "caching": st.booleans(),
    "chunked": st.booleans(),
    "policy": st.sampled_from(["fcfs", "priority", "spf"]),
    "max_history": st.sampled_from([1, 3, 10_000]),
    "reset_at": st.one_of(st.none(), st.integers(0, 20)),
    "capture": st.booleans(),
})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, specs=st.lists(request_st, min_size=2, max_size=7))
def test_rebuilt_pool_equals_live_snapshot_after_every_step(cfg, specs):
    t = Harness(cfg["num_blocks"], cfg["block_size"], budget=cfg["budget"], max_num_seqs=cfg["max_num_seqs"],
                caching=cfg["caching"], chunked=cfg["chunked"], policy=cfg["policy"],
                max_history=cfg["max_history"], max_model_len=48, capture=cfg["capture"])
    base = list(range(100, 112))
    added = set()
    for step in range(200):
        for i, (arrival, prefix, suffix, max_tokens, priority, _) in enumerate(specs):
            if arrival == step:
                try:
                    t.add(f"r{i}", base[:prefix] + suffix or [0], max_tokens, arrival=i, priority=priority)
                    added.add(f"r{i}")
                except ValueError:
                    pass
        aborts = [(f"r{i}", spec[5][1]) for i, spec in enumerate(specs) if spec[5] and spec[5][0] == step]
        for rid, mid in aborts:
            if not mid:
                t.s.abort_request(rid)  # between steps: lands in the next record
        if cfg["reset_at"] == step and t.kv.num_free_blocks == t.kv.num_blocks:
            assert t.kv.reset_prefix_cache()
            event("cache reset")
        if step > max(s[0] for s in specs) and not t.s.has_unfinished_requests() and not aborts:
            break  # (an abort's events land in the next record: one more step records them)
        record = t.step(abort_mid_step=[rid for rid, mid in aborts if mid and rid in t.s.requests])
        assert t.history.kv_state(record.step) == t.live[record.step]
    for step in t.history.steps:  # scrub back through what the bounded history kept
        assert t.history.kv_state(step) == t.live[step]
    rows = t.tracker.rows()
    assert {r["request_id"] for r in rows} == added
    for r in rows:
        assert r["finish_reason"] in ("length", "abort")
        if r["num_recomputed_tokens"]:
            assert r["num_preemptions"] >= 1
        if r["finish_reason"] == "length":
            assert r["e2e_steps"] >= r["ttft_steps"] >= 1 and not math.isnan(r["ttft_s"])
    kinds = {type(e).__name__ for rec in t.history for e in rec.kv_events}
    event("evicted" if "BlockRemoved" in kinds else "no eviction")
    event("preempted" if any(r["num_preemptions"] for r in rows) else "no preemption")
    event("prefix hit" if t.kv.prefix_cache_stats.hits else "no hit")


def test_tracker_keeps_the_last_arrivals_and_ignores_unknown_requests():
    from workbench.core.request_events import RequestArrived, RequestFinished, RequestFirstToken

    t = RequestTracker(max_requests=2)
    t.consume([RequestArrived(f"r{i}", i, 10.0 + i, 3, 0) for i in range(3)])
    t.consume([RequestFirstToken("ghost", 3, 14.0), RequestFinished("r0", 3, 15.0, "abort", 0)])
    rows = t.rows()
    assert [r["request_id"] for r in rows] == ["r1", "r2"]
    assert rows[0]["arrival_s"] == 1.0  # the epoch is the first arrival seen (r0's)
    assert rows[0]["finish_reason"] is None and math.isnan(rows[0]["ttft_s"])


def test_a_block_state_is_a_frozen_value():
    import gc
    import pickle

    for fields in ((3, 0, None, (), ()), (7, 2, b"h" * 32, (5, 6, 7), ("a", "b"))):
        built, again = BlockState(*fields), BlockState(*fields)
        assert built == again and hash(built) == hash(again) and pickle.loads(pickle.dumps(built)) == built
        assert repr(built).startswith(f"BlockState(block_id={fields[0]}, ref_count={fields[1]}, ")
        assert not gc.is_tracked(built)
        with pytest.raises(AttributeError):
            built.ref_count = 9
