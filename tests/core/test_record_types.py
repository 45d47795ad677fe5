"""The step's per-request record types (``ScheduledRequest``, the request and KV events) are
msgspec Structs: read-only, equal and hashable by value, with the repr a dataclass of the
same fields would print (logs, notebooks and the records digest read it), picklable (they
cross to and from the engine-core process inside step records)."""

import copy
import gc
import pickle

import msgspec
import pytest

from workbench.core.kv_events import (
    AllBlocksCleared,
    BlockAllocated,
    BlockFreed,
    BlockRemoved,
    BlockStored,
    BlockWritten,
    describe,
)
from workbench.core.request_events import (
    RequestArrived,
    RequestEvent,
    RequestFinished,
    RequestFirstToken,
    RequestPrefixHit,
    RequestScheduled,
)
from workbench.core.sched.output import ScheduledRequest


def test_scheduled_request_is_a_value():
    chunk = ScheduledRequest("r1", 16, 1, (7,), (3, 4), False, True)
    assert repr(chunk) == ("ScheduledRequest(request_id='r1', num_computed_tokens=16, num_new_tokens=1, "
                           "token_ids=(7,), block_ids=(3, 4), is_prefill=False, samples=True, "
                           "num_cached_tokens=0, lora_name=None, spec_token_ids=())")
    same = ScheduledRequest(request_id="r1", num_computed_tokens=16, num_new_tokens=1, token_ids=(7,),
                            block_ids=(3, 4), is_prefill=False, samples=True)
    assert chunk == same and hash(chunk) == hash(same)
    assert chunk != msgspec.structs.replace(chunk, token_ids=(8,))
    assert chunk.seq_len == 17
    with pytest.raises(AttributeError):
        chunk.num_new_tokens = 2
    assert pickle.loads(pickle.dumps(chunk)) == chunk and copy.deepcopy(chunk) == chunk
    assert not gc.is_tracked(chunk)


def test_request_events_leave_time_out_of_repr_equality_and_hash():
    event = RequestScheduled("r1", 5, 12.5, 16, 1, False, True)
    assert repr(event) == ("RequestScheduled(request_id='r1', step=5, start=16, num_tokens=1, "
                           "is_prefill=False, samples=True)")
    later = RequestScheduled("r1", 5, 99.0, 16, 1, False, True)
    assert event == later and hash(event) == hash(later) and later.time == 99.0
    assert event != RequestScheduled("r1", 5, 12.5, 17, 1, False, True)
    assert RequestFirstToken("r1", 5) != RequestArrived("r1", 5)  # same fields, another kind
    assert repr(RequestFinished("r2", 9, 1.0, "stop", 3)) == (
        "RequestFinished(request_id='r2', step=9, reason='stop', num_output_tokens=3, pooled=False)")
    assert repr(RequestPrefixHit("r3", 0, num_tokens=32, block_ids=(1, 2))) == (
        "RequestPrefixHit(request_id='r3', step=0, num_tokens=32, block_ids=(1, 2))")
    with pytest.raises(AttributeError):
        event.step = 6
    copied = pickle.loads(pickle.dumps(event))
    assert copied == event and copied.time == 12.5
    assert {cls.kind for cls in RequestEvent.__subclasses__()} >= {"scheduled", "finished", "arrived"}
    assert not gc.is_tracked(event)


def test_kv_events_are_values_with_dataclass_reprs():
    events = [BlockAllocated(4, "r1"), BlockFreed(4, "r1"), BlockWritten(4, (7, 8)),
              BlockStored((4,), (b"\x01" * 32,), None, (7, 8), 2), BlockRemoved((b"\x01" * 32,), (4,)),
              AllBlocksCleared()]
    assert [repr(e) for e in events[:3]] == [
        "BlockAllocated(block_id=4, request_id='r1', prefix_hit=False)",
        "BlockFreed(block_id=4, request_id='r1')",
        "BlockWritten(block_id=4, token_ids=(7, 8))",
    ]
    assert repr(events[-1]) == "AllBlocksCleared()"
    assert describe(events[4]) == "evicted from the prefix cache: 4:01010101"
    assert BlockAllocated(4, "r1") == BlockAllocated(4, "r1", prefix_hit=False) != BlockAllocated(4, "r1", True)
    assert BlockAllocated(4, "r1") != BlockFreed(4, "r1")
    assert len(set(events) | set(pickle.loads(pickle.dumps(events)))) == len(events)
    with pytest.raises(AttributeError):
        events[2].token_ids = ()
    assert not any(gc.is_tracked(e) for e in events)
