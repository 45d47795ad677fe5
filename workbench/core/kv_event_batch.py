"""KV events on the wire, exactly as vLLM publishes them (``vllm/distributed/kv_events.py``).

msgspec structs encoded as msgpack arrays (``array_like``), the events tagged by class name
(``tag=True``), so a subscriber written from vLLM's schema alone decodes them::

    KVEventBatch(ts, events, data_parallel_rank)
    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)
    BlockRemoved(block_hashes, medium)
    AllBlocksCleared()

:func:`to_kv_event_batch` turns the pool's own events (:mod:`workbench.core.kv_events`) of a
step into one batch: the prefix-cache changes only (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), in order; the pool's bookkeeping events (allocations, frees, writes
of uncached blocks) are not part of vLLM's vocabulary and are left out. Block hashes are the
prefix cache's 32-byte chained hashes (:mod:`workbench.core.kv_cache_utils`); vLLM's
``ExternalBlockHash`` is bytes or int, so they decode as it does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from workbench.core import kv_events


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change to the prefix cache (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_kv_event_batch(events: Iterable[kv_events.KVEvent], *, ts: float, data_parallel_rank: int | None = None,
                      medium: str | None = "GPU", lora_id: int | None = None) -> KVEventBatch:
    """The prefix-cache changes among ``events`` (in order) as one vLLM batch at time ``ts``."""
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for e in events:
        if type(e) is kv_events.BlockStored:
            out.append(BlockStored(list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size,
                                   lora_id, medium))
        elif type(e) is kv_events.BlockRemoved:
            out.append(BlockRemoved(list(e.block_hashes), medium))
        elif type(e) is kv_events.AllBlocksCleared:
            out.append(AllBlocksCleared())
    return KVEventBatch(ts=ts, events=out, data_parallel_rank=data_parallel_rank)
