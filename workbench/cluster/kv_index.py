"""KVBlockIndex: each replica's prefix cache as its KV events describe it (vLLM's KV event schema).

``apply(replica, batch)`` folds a :class:`~workbench.core.kv_event_batch.KVEventBatch` in:
``BlockStored`` adds its hashes, ``BlockRemoved`` drops its, ``AllBlocksCleared`` empties the
replica's set. Applied to every batch a replica published, in order, the index holds exactly
the hashes its prefix cache holds (tests/cluster/test_kv_events.py checks it after every step).
``leading_blocks(replica, hashes)`` counts how many of a prompt's chained block hashes, from
the first, the replica holds: the blocks a request routed there would find cached.
"""

from __future__ import annotations

from collections.abc import Sequence

from workbench.core.kv_event_batch import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class KVBlockIndex:
    def __init__(self) -> None:
        self.blocks: dict[int, set] = {}

    def apply(self, replica: int, batch: KVEventBatch) -> None:
        held = self.blocks.setdefault(replica, set())
        for event in batch.events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()

    def leading_blocks(self, replica: int, hashes: Sequence) -> int:
        held = self.blocks.get(replica, ())
        n = 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        return n
