"""KVState: an immutable picture of a block pool, taken live or rebuilt from block events.

``KVCacheManager.snapshot()`` captures the live pool; ``state.apply(events)`` rolls a state
forward through the pool's :mod:`~workbench.core.kv_events`. Both give the same type, so a
state rebuilt from a step history compares equal (``==``) to a snapshot taken live at that
step: same ref counts, owners, hashes, tokens, free-queue (eviction) order and block tables.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from workbench.core.kv_events import (
    AllBlocksCleared,
    BlockAllocated,
    BlockFreed,
    BlockRemoved,
    BlockStored,
    BlockWritten,
    KVEvent,
)


BLOCK_STATES = ("used", "shared", "cached", "free", "never used")
"""Every state a block can be in (see :func:`block_state`), in display order."""


def block_state(block, never_used: bool = False) -> str:
    """The state of ``block`` (a live ``KVCacheBlock`` or a :class:`BlockState`): "shared"
    (ref_count > 1), "used" (ref_count 1), "cached" (free, evictable, still a prefix-cache
    hit), else "free" (free, holds nothing) -- or "never used" when the caller says the free
    block was never handed out (see :func:`never_used_blocks`). The one classification
    every view of a pool uses."""
    if block.ref_count > 1:
        return "shared"
    if block.ref_count == 1:
        return "used"
    if block.block_hash is not None:
        return "cached"
    return "never used" if never_used else "free"


def never_used_blocks(free_queue: Sequence[int], num_blocks: int) -> set[int]:
    """Blocks never handed out. The queue starts as ``0..N-1`` and allocation pops its front
    while freed blocks join its back, so the never-used blocks are exactly a front run
    ``k, k+1, ..., N-1`` of the queue (empty once block N-1 has been handed out)."""
    if not free_queue:
        return set()
    run = list(range(free_queue[0], num_blocks))
    return set(run) if list(free_queue[: len(run)]) == run else set()


class BlockState(msgspec.Struct, frozen=True, gc=False):
    """One block: ``owners`` are the request ids holding it, in the order they took it
    (``ref_count == len(owners)``); ``block_hash`` is set while it is in the prefix cache.
    A frozen ``msgspec.Struct``, like the events that change it: a capture builds one per
    block and a replay one per event, in C, untracked by the cycle collector."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    owners: tuple[str, ...] = ()

    @property
    def state(self) -> str:
        """:func:`block_state` of this block: "shared", "used", "cached" or "free"."""
        return block_state(self)

    def _repr_html_(self) -> str:
        h = self.block_hash.hex()[:16] if self.block_hash is not None else "-"
        return (
            f"<b>block {self.block_id}</b> ({self.state}): ref_count {self.ref_count}, hash {h}, "
            f"owners {html.escape(', '.join(self.owners) or '-')}, tokens {list(self.token_ids)}"
        )


@dataclass(frozen=True)
class KVState:
    """The pool at one moment. ``free_queue`` lists the free block ids, next evicted first;
    ``tables`` maps each request holding blocks to its block table (logical order)."""

    block_size: int
    blocks: tuple[BlockState, ...]
    free_queue: tuple[int, ...]
    tables: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def empty(cls, num_blocks: int, block_size: int) -> KVState:
        """A fresh pool: every block free and uncached, queued in id order."""
        return cls(block_size, tuple(BlockState(i) for i in range(num_blocks)), tuple(range(num_blocks)))

    @classmethod
    def capture(cls, pool, tables: Mapping[str, Iterable[int]], block_size: int) -> KVState:
        """The state of a live :class:`~workbench.core.block_pool.BlockPool` and its tables."""
        make = BlockState  # a live block's token_ids are a tuple already
        blocks = tuple([make(b.block_id, b.ref_count, b.block_hash, b.token_ids, tuple(b._owners))
                        for b in pool.blocks])
        kept = {rid: tuple(ids) for rid, ids in tables.items() if ids}
        return cls(block_size, blocks, tuple(pool.free_queue.block_ids()), kept)

    # ----------------------------------------------------------------- views
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0, cached ones included (they are evictable)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one request, in [0, 1]."""
        return 1.0 - len(self.free_queue) / len(self.blocks)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by the prefix cache (in use or not)."""
        return sum(b.block_hash is not None for b in self.blocks)

    def block_table(self, request_id: str) -> list[int]:
        """Physical block ids of the request, in logical order ([] when it holds none)."""
        return list(self.tables.get(request_id, ()))

    def counts(self) -> dict[str, int]:
        """Blocks per :attr:`BlockState.state`: free, cached, used, shared."""
        out = dict.fromkeys(("free", "cached", "used", "shared"), 0)
        for b in self.blocks:
            out[b.state] += 1
        return out

    # ---------------------------------------------------------------- replay
    def apply(self, events: Iterable[KVEvent]) -> KVState:
        """The state after ``events`` (a pool's events, in order, from this state on).

        Raises ValueError naming the event when one does not fit the state (events from
        another pool, or missing ones)."""
        return KVReplay(self).run(events).freeze()

    # ------------------------------------------------------------------ repr
    def __repr__(self) -> str:
        c = self.counts()
        tables = ", ".join(f"{rid}: {list(ids)}" for rid, ids in sorted(self.tables.items()))
        return (
            f"KVState(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.num_free_blocks} (cached {c['cached']}), used={c['used']}, "
            f"shared={c['shared']}, usage={self.usage:.1%}, tables={{{tables}}})"
        )

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(rid)}</td><td>{' '.join(map(str, ids))}</td></tr>"
            for rid, ids in sorted(self.tables.items())
        )
        c = self.counts()
        return (
            f"<div><b>KVState</b> {self.num_blocks} blocks x {self.block_size} slots: "
            + ", ".join(f"{n} {k}" for k, n in c.items())
            + f", usage {self.usage:.1%}; next evicted: {' '.join(map(str, self.free_queue[:16]))}"
            + ("..." if len(self.free_queue) > 16 else "")
            + f"<table><tr><th>request</th><th>block table</th></tr>{rows}</table></div>"
        )


class KVReplay:
    """Applies block events to a copy of a KVState; :meth:`freeze` may be called between runs.

    Blocks stay immutable :class:`BlockState` objects: an event replaces the ones it touches,
    so frozen states share every block that did not change. The free queue is an insertion-ordered dict (removal from anywhere and appending are O(1)). ``BlockWritten``
    (one per decoding request per step, each overwriting its tail block's tokens) only notes
    the tokens; the block is rebuilt when another event reads it or at :meth:`freeze`.
    """

    def __init__(self, state: KVState):
        self.block_size = state.block_size
        self.blocks = list(state.blocks)
        self.free = dict.fromkeys(state.free_queue)
        self.tables = {rid: list(ids) for rid, ids in state.tables.items()}
        self._written: dict[int, tuple[int, ...]] = {}  # block id -> tokens not yet in its BlockState

    def run(self, events: Iterable[KVEvent]) -> KVReplay:
        handlers = self._HANDLERS
        for event in events:
            try:
                handler = handlers.get(type(event))
                if handler is None:
                    raise ValueError("unknown event type")
                handler(self, event)
            except (IndexError, KeyError, ValueError) as e:
                raise ValueError(f"block event {event!r} does not fit the pool state: {e!r}") from None
        return self

    # One handler per event type (a dict lookup, not a chain of pattern tests: a history that
    # keeps a bounded number of steps replays every dropped step's events).
    def _block(self, b: int) -> BlockState:
        """Block ``b`` as it is now (its noted tokens applied)."""
        block = self.blocks[b]
        tokens = self._written.pop(b, None)
        if tokens is not None:
            block = self.blocks[b] = BlockState(b, block.ref_count, block.block_hash, tokens, block.owners)
        return block

    def _allocated(self, event: BlockAllocated) -> None:
        b, rid = event.block_id, event.request_id
        block = self._block(b)
        if block.ref_count == 0:
            del self.free[b]
        if not event.prefix_hit and block.block_hash is not None:
            raise ValueError(f"block {b} is allocated while still cached")
        self.blocks[b] = BlockState(
            b, block.ref_count + 1, block.block_hash, block.token_ids if event.prefix_hit else (),
            block.owners + (rid,),
        )
        self.tables.setdefault(rid, []).append(b)

    def _freed(self, event: BlockFreed) -> None:
        b, rid = event.block_id, event.request_id
        block = self._block(b)
        if rid not in block.owners:
            raise ValueError(f"{rid!r} does not own block {b}")
        ref = block.ref_count - 1
        self.blocks[b] = BlockState(
            b, ref, block.block_hash, () if ref == 0 and block.block_hash is None else block.token_ids,
            tuple(o for o in block.owners if o != rid),
        )
        table = self.tables[rid]
        table.remove(b)
        if not table:
            del self.tables[rid]
        if ref == 0:
            self.free[b] = None

    def _stored(self, event: BlockStored) -> None:
        size, tokens = event.block_size, event.token_ids
        for i, (b, h) in enumerate(zip(event.block_ids, event.block_hashes, strict=True)):
            block = self._block(b)
            self.blocks[b] = BlockState(b, block.ref_count, h, tuple(tokens[i * size : (i + 1) * size]),
                                              block.owners)

    def _written(self, event: BlockWritten) -> None:
        b = event.block_id
        if not 0 <= b < len(self.blocks):
            raise IndexError(f"the pool has no block {b}")
        self._written[b] = tuple(event.token_ids)

    def _uncache(self, b: int) -> None:
        block = self._block(b)
        self.blocks[b] = BlockState(b, block.ref_count, None, (), block.owners)

    def _removed(self, event: BlockRemoved) -> None:
        (b,) = event.block_ids  # one event per evicted block
        self._uncache(b)

    def _cleared(self, event: AllBlocksCleared) -> None:
        for block in self.blocks:
            if block.block_hash is not None:
                self._uncache(block.block_id)

    _HANDLERS = {
        BlockAllocated: _allocated,
        BlockFreed: _freed,
        BlockStored: _stored,
        BlockWritten: _written,
        BlockRemoved: _removed,
        AllBlocksCleared: _cleared,
    }

    def freeze(self) -> KVState:
        """The state so far (O(num_blocks) pointer copies; unchanged blocks are shared)."""
        for b in list(self._written):
            self._block(b)
        return KVState(
            self.block_size,
            tuple(self.blocks),
            tuple(self.free),
            {rid: tuple(ids) for rid, ids in self.tables.items()},
        )
