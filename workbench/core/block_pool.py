"""Physical KV blocks, the O(1) free queue in eviction order, and the block pool.

Invariants (checked by :meth:`BlockPool.check_invariants`):

* a block is in the free queue iff its ``ref_count`` is 0;
* ``ref_count == len(owners)``: every owner holds exactly one reference;
* ``cached[h] is b`` iff ``b.block_hash == h``: at most one block per hash; a cached
  block holds ``block_size`` token ids.

Eviction is lazy: a freed block keeps its hash (and stays findable by the prefix cache)
until the free queue hands it out for new content; only then is the hash dropped.

With ``record_events`` every change is also appended, as it happens, to an event list
(:mod:`workbench.core.kv_events`) that :meth:`BlockPool.take_events` drains; replaying those
events on a snapshot of the pool rebuilds it exactly.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Iterator, Sequence

from workbench.core.kv_events import (
    AllBlocksCleared,
    BlockAllocated,
    BlockFreed,
    BlockRemoved,
    BlockStored,
    BlockWritten,
    KVEvent,
)


class KVCacheBlock:
    """One physical block of ``block_size`` KV slots.

    ``token_ids`` are the tokens whose K/V the block holds (``block_size`` of them once full,
    fewer in a request's partial tail block, none when free and uncached). ``block_hash`` is
    set only while the block is in the prefix cache. ``prev_free``/``next_free`` link the block
    into the :class:`FreeBlockQueue` and are None when it is not queued.
    """

    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "_owners", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()
        self._owners: dict[str, None] = {}  # insertion-ordered set of request ids
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    @property
    def owners(self) -> tuple[str, ...]:
        """Ids of the requests whose block table holds this block, in the order they took it."""
        return tuple(self._owners)

    def __deepcopy__(self, memo: dict) -> KVCacheBlock:
        """The block's content without its free-queue links (the copied queue relinks its
        copies), so copying a pool never recurses along the queue."""
        new = KVCacheBlock(self.block_id)
        memo[id(self)] = new
        new.ref_count, new.block_hash, new.token_ids = self.ref_count, self.block_hash, self.token_ids
        new._owners = dict(self._owners)
        return new

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return (
            f"KVCacheBlock(id={self.block_id}, ref_count={self.ref_count}, hash={h}, "
            f"tokens={list(self.token_ids)}, owners={list(self._owners)})"
        )


class FreeBlockQueue:
    """Doubly linked list of free blocks; the front is evicted (reused) first.

    All operations are O(1) except iteration: ``popleft`` takes the least recently freed
    block, ``append`` puts a freed block at the back, ``remove`` unlinks a block from
    anywhere (a prefix-cache hit on a free block). Sentinel head and tail nodes avoid
    special cases; the links live on the blocks themselves.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def __deepcopy__(self, memo: dict) -> FreeBlockQueue:
        """A queue of the blocks' copies in the same order (``engine.fork()``)."""
        new = FreeBlockQueue(copy.deepcopy(b, memo) for b in self)
        memo[id(self)] = new
        return new

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def __contains__(self, block: KVCacheBlock) -> bool:
        """O(1): a block is queued iff it is linked."""
        return block.prev_free is not None

    def popleft(self) -> KVCacheBlock:
        """Unlink and return the front block; ValueError("No free blocks available") when
        empty (vLLM's type and message)."""
        head = self._head
        block = head.next_free
        if block is self._tail:
            raise ValueError("No free blocks available")
        nxt = block.next_free
        head.next_free = nxt
        nxt.prev_free = head
        block.prev_free = block.next_free = None
        self._len -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Unlink and return the ``n`` front blocks, front first, in one pass (vLLM's name);
        ValueError when fewer than ``n`` are queued, with nothing unlinked."""
        if n > self._len:
            raise ValueError(f"cannot take {n} blocks: only {self._len} free.")
        out = []
        block = self._head.next_free
        for _ in range(n):
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        self._head.next_free = block
        block.prev_free = self._head
        self._len -= n
        return out

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def extend(self, blocks: list[KVCacheBlock]) -> None:
        """``append`` each block in order, linked in one pass (a finished request's table);
        nothing is linked when one of them is already queued (ValueError)."""
        queued = next((b for b in blocks if b.prev_free is not None), None)
        if queued is not None:
            raise ValueError(f"block {queued.block_id} is already in the free queue")
        tail = self._tail
        last = tail.prev_free
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
        last.next_free = tail
        tail.prev_free = last
        self._len += len(blocks)

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a queued block; RuntimeError for one not queued (vLLM's type)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on block {block.block_id}, which is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def block_ids(self) -> list[int]:
        """Queued block ids, front (next evicted) first. O(n): for inspection and tests."""
        return [b.block_id for b in self]

    def __repr__(self) -> str:
        ids = self.block_ids()
        shown = ", ".join(map(str, ids[:16])) + (f", ... +{len(ids) - 16} more" if len(ids) > 16 else "")
        return f"FreeBlockQueue({len(ids)} blocks, next evicted first: [{shown}])"


class BlockPool:
    """All physical blocks, their reference counts and the prefix-cache hash map.

    Counters ``num_allocated`` (blocks handed out by :meth:`get_new_blocks`),
    ``num_evicted`` (cached blocks whose hash was dropped to serve them) and ``num_freed``
    (blocks whose ref_count fell to 0) only grow; readers report differences.
    ``cache_version`` grows whenever the prefix cache's content (``cached``) changes, so a
    lookup can be reused while it stays the same. ``num_evictable`` is the number of free
    blocks that hold cached content (kept as blocks move, so reading it is O(1)).
    """

    def __init__(self, num_blocks: int, record_events: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}.")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.num_allocated = 0
        self.num_evicted = 0
        self.num_freed = 0
        self.cache_version = 0
        self.num_evictable = 0
        # One list for the pool's lifetime (take_events empties it), so the KVCacheManager
        # appends the events it records itself (a decode's BlockWritten) to it directly.
        self._events: list[KVEvent] | None = [] if record_events else None
        #: Told of each eviction (a ``PrefixMemory``; None: nobody listens).
        self.prefix_memory = None

    @property
    def record_events(self) -> bool:
        return self._events is not None

    def take_events(self) -> tuple[KVEvent, ...]:
        """The events since the previous call, oldest first (empty when not recording)."""
        if not self._events:
            return ()
        events = tuple(self._events)
        self._events.clear()
        return events

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0, cached ones included (they are evictable)."""
        return len(self.free_queue)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int, owner: str) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the front of the free queue, evicting their cached content.

        Records one ``BlockRemoved`` per evicted block (as vLLM does), in eviction order, then
        one ``BlockAllocated`` per block handed out."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self.free_queue)} free.")
        out = self.free_queue.popleft_n(n)
        events, memory, cached = self._events, self.prefix_memory, self.cached
        num_evicted = 0
        for block in out:
            block_hash = block.block_hash
            if block_hash is not None:
                if events is not None:
                    events.append(BlockRemoved((block_hash,), (block.block_id,)))
                if memory is not None:
                    memory.evicted(block_hash, owner)
                del cached[block_hash]
                block.block_hash = None
                num_evicted += 1
            block.token_ids = ()
            block.ref_count = 1
            block._owners[owner] = None
        if num_evicted:
            self.num_evictable -= num_evicted
            self.num_evicted += num_evicted
            self.cache_version += num_evicted
        self.num_allocated += n
        if events is not None:
            events.extend([BlockAllocated(b.block_id, owner) for b in out])
        return out

    def touch(self, blocks: Iterable[KVCacheBlock], owner: str) -> None:
        """Take one more reference on each block (a prefix-cache hit); free ones leave the queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self.num_evictable -= 1
            block.ref_count += 1
            block._owners[owner] = None
            if self._events is not None:
                self._events.append(BlockAllocated(block.block_id, owner, prefix_hit=True))

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], owner: str) -> None:
        """Drop ``owner``'s reference on each block; blocks reaching 0 join the queue's back
        in the given order (so the first given is evicted first). Uncached blocks forget
        their tokens; cached ones keep them for later hits (lazy eviction)."""
        events = self._events
        released = []
        for block in ordered_blocks:
            del block._owners[owner]
            block.ref_count -= 1
            if events is not None:
                events.append(BlockFreed(block.block_id, owner))
            if block.ref_count == 0:
                if block.block_hash is None:
                    block.token_ids = ()
                else:
                    self.num_evictable += 1
                released.append(block)
        self.free_queue.extend(released)
        self.num_freed += len(released)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        """Record a full, computed block under ``block_hash``. Returns False (and leaves the
        block uncached, its tokens recorded) when another block already holds that hash.
        Emits no event: :meth:`cache_full_blocks` is the recorded entry point."""
        block.token_ids = token_ids
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if block.ref_count == 0:
            self.num_evictable += 1
        self.cache_version += 1
        return True

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        parent_hash: bytes | None,
        token_ids: Sequence[tuple[int, ...]],
        block_size: int,
    ) -> None:
        """Cache consecutive full blocks of one request (``parent_hash`` chains before the
        first). Emits one ``BlockStored`` per run of blocks that entered the cache and a
        ``BlockWritten`` for each that could not (its hash is held by another block)."""
        first = 0  # the current run of stored blocks is first..i-1
        for i, (block, block_hash, tokens) in enumerate(zip(blocks, block_hashes, token_ids)):
            if self.cache_block(block, block_hash, tokens) or self._events is None:
                continue
            self._flush_stored(first, i, blocks, block_hashes, parent_hash, token_ids, block_size)
            first = i + 1
            self._events.append(BlockWritten(block.block_id, tokens))
        if self._events is not None:
            self._flush_stored(first, len(token_ids), blocks, block_hashes, parent_hash, token_ids, block_size)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes, parent_hash: bytes | None,
                         token_ids: tuple[int, ...], block_size: int) -> None:
        """:meth:`cache_full_blocks` of one block (a decode's block that filled up), with the
        same events: a ``BlockStored`` of it, or a ``BlockWritten`` when another block holds
        its hash."""
        if self.cache_block(block, block_hash, token_ids):
            if self._events is not None:
                self._events.append(BlockStored((block.block_id,), (block_hash,), parent_hash, token_ids, block_size))
        elif self._events is not None:
            self._events.append(BlockWritten(block.block_id, token_ids))

    def _flush_stored(self, first, end, blocks, block_hashes, parent_hash, token_ids, block_size) -> None:
        """One ``BlockStored`` for the run of blocks ``first..end-1`` (none when empty). A run
        of one block (a decode's block that filled up: most runs) takes its id and its own
        token tuple as they are."""
        if first >= end:
            return
        if end - first == 1:
            ids, tokens = (blocks[first].block_id,), token_ids[first]
        else:
            ids = tuple([b.block_id for b in blocks[first:end]])
            tokens = tuple(itertools.chain.from_iterable(token_ids[first:end]))
        parent = block_hashes[first - 1] if first else parent_hash
        self._events.append(BlockStored(ids, tuple(block_hashes[first:end]), parent, tokens, block_size))

    def write_tokens(self, block: KVCacheBlock, token_ids: tuple[int, ...]) -> None:
        """Record the tokens an uncached block holds (a partial tail, or caching off). A
        decode's tail is written by ``KVCacheManager.cache_blocks`` itself, with the same event."""
        block.token_ids = token_ids
        if self._events is not None:
            self._events.append(BlockWritten(block.block_id, token_ids))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed while no block is in use; returns success."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
            block.token_ids = ()
        self.cached.clear()
        self.num_evictable = 0
        self.cache_version += 1
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def check_invariants(self, block_size: int) -> None:
        """Raise AssertionError naming the first broken pool invariant."""
        queued = self.free_queue.block_ids()
        assert len(queued) == len(self.free_queue), (
            f"free queue length {len(self.free_queue)} != {len(queued)} linked blocks"
        )
        assert len(set(queued)) == len(queued), f"free queue holds a block twice: {queued}"
        queued_set = set(queued)
        for b in self.blocks:
            assert (b.block_id in queued_set) == (b.ref_count == 0), (
                f"block {b.block_id}: ref_count={b.ref_count} but "
                f"{'in' if b.block_id in queued_set else 'not in'} the free queue"
            )
            assert b.ref_count == len(b._owners), (
                f"block {b.block_id}: ref_count={b.ref_count} != {len(b._owners)} owners {b.owners}"
            )
            if b.block_hash is not None:
                assert self.cached.get(b.block_hash) is b, (
                    f"block {b.block_id} has a hash that the cache maps to another block"
                )
                assert len(b.token_ids) == block_size, (
                    f"cached block {b.block_id} holds {len(b.token_ids)} tokens, not {block_size}"
                )
        for h, b in self.cached.items():
            assert b.block_hash == h, f"cache entry for block {b.block_id} has a stale hash"
        evictable = sum(1 for b in self.cached.values() if b.ref_count == 0)
        assert self.num_evictable == evictable, (
            f"num_evictable={self.num_evictable} but {evictable} free blocks hold cached content")
