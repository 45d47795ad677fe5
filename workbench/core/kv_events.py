"""KV-cache block events: every change to the block pool, in the order it happened.

The vocabulary follows vLLM's KV events (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) and adds what an exact replay of the pool needs: which request took
(``BlockAllocated``) or dropped (``BlockFreed``) a reference, and the tokens written into a
block that is not (yet) cached (``BlockWritten``). Applying a pool's events, in order, to a
snapshot of it taken before them yields the pool after them (see
:mod:`workbench.core.kv_state`); nothing else changes a pool.

Free-queue moves are implied, so no event of their own is needed: a block leaves the queue
when a reference is taken on it at ref count 0 (``BlockAllocated``), and joins its back when
its last reference is dropped (``BlockFreed``).

Events are read-only records, equal and hashable by value: frozen ``msgspec.Struct``s (vLLM's
KV events are msgspec Structs too), built in C and not tracked by the cycle collector (they
hold numbers, strings, bytes and tuples of them). One or more is built per request per step; a
slotted dataclass costs about three times as much to build (a frozen one more).
"""

from __future__ import annotations

import html

import msgspec


class _EventRepr(msgspec.Struct, frozen=True, gc=False):
    """The base of the events: an HTML repr, its one-line description."""

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(describe(self))}</code>"


class BlockAllocated(_EventRepr, frozen=True, gc=False):
    """``request_id`` took a reference on ``block_id``, appending it to its block table.

    ``prefix_hit`` False: a fresh block from the front of the free queue; its tokens are
    cleared (a cached one first had a ``BlockRemoved``). True: a prefix-cache hit; the block
    keeps its hash and tokens and leaves the free queue if it was in it.
    """

    block_id: int
    request_id: str
    prefix_hit: bool = False


class BlockFreed(_EventRepr, frozen=True, gc=False):
    """``request_id`` dropped its reference on ``block_id`` (its table is released tail first).

    At ref count 0 the block joins the back of the free queue; an uncached block then forgets
    its tokens, a cached one keeps them for later hits (lazy eviction).
    """

    block_id: int
    request_id: str


class BlockStored(_EventRepr, frozen=True, gc=False):
    """Full, computed blocks entered the prefix cache (vLLM's ``BlockStored``).

    ``block_ids[i]`` now holds ``token_ids[i * block_size:(i + 1) * block_size]`` under
    ``block_hashes[i]``; ``parent_block_hash`` is the hash chained before ``block_hashes[0]``
    (None for a request's first block).
    """

    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int


class BlockWritten(_EventRepr, frozen=True, gc=False):
    """``block_id`` now holds ``token_ids`` (computed K/V) without being cached: a request's
    partial tail block, a full block with prefix caching off, or a full block whose hash
    another block already holds."""

    block_id: int
    token_ids: tuple[int, ...]


class BlockRemoved(_EventRepr, frozen=True, gc=False):
    """One cached block was evicted (vLLM's ``BlockRemoved``, one event per block): its hash
    left the prefix cache and its tokens were dropped, to serve the allocation that follows.

    ``block_hashes == (hash,)`` and ``block_ids == (block_id,)``: one-element sequences, the
    shape of vLLM's event, so its consumers read ``block_hashes[0]`` unchanged.
    """

    block_hashes: tuple[bytes]
    block_ids: tuple[int]


class AllBlocksCleared(_EventRepr, frozen=True, gc=False):
    """Every cached hash was forgotten (``reset_prefix_cache``); no block was in use."""


KVEvent = BlockAllocated | BlockFreed | BlockStored | BlockWritten | BlockRemoved | AllBlocksCleared


def describe(event: KVEvent) -> str:
    """One deterministic line: what the event did, hashes shortened to 8 hex digits."""
    match event:
        case BlockAllocated(block_id, request_id, prefix_hit):
            return f"{request_id} {'shares cached' if prefix_hit else 'allocates'} block {block_id}"
        case BlockFreed(block_id, request_id):
            return f"{request_id} frees block {block_id}"
        case BlockStored(block_ids, block_hashes, _, _, _):
            stored = ", ".join(f"{b}:{h.hex()[:8]}" for b, h in zip(block_ids, block_hashes))
            return f"stored in the prefix cache: {stored}"
        case BlockWritten(block_id, token_ids):
            return f"block {block_id} holds {len(token_ids)} tokens"
        case BlockRemoved((block_hash,), (block_id,)):
            return f"evicted from the prefix cache: {block_id}:{block_hash.hex()[:8]}"
        case AllBlocksCleared():
            return "prefix cache cleared"
    raise TypeError(f"not a KV event: {event!r}")
