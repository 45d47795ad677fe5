"""KVCacheManager: per-request block tables over a :class:`BlockPool`, with prefix caching.

Life of a request's blocks (vLLM v1 style):

1. ``get_computed_blocks(request)`` looks up the request's full blocks in the prefix cache
   (chained sha256 hashes, then the stored tokens are compared too). The hit is capped so
   the last known token is always computed: a prompt of exactly N cached blocks reuses N-1.
2. ``allocate_slots(request, n, hit_blocks)`` takes a reference on the hit blocks (shared
   blocks have ref_count > 1; nothing is copied) and enough new blocks for
   ``num_computed_tokens + hits + n`` tokens. If the pool cannot serve it, it returns None
   and changes nothing.
3. ``cache_blocks(request, num_computed_tokens)`` runs after the step computed the tokens:
   newly full blocks enter the prefix cache (a block is cached only once its K/V exist).
4. ``free(request)`` drops the request's references, tail block first, so when several
   blocks become free the tail (least likely to be a shared prefix) is evicted first.

Invariants (``check_invariants``): the pool's (free queue iff ref_count 0, ref_count ==
owners, one block per hash); each block table holds ``ceil(tokens / block_size)`` distinct
blocks where tokens = num_computed_tokens (+ tokens scheduled but not yet computed, draft
tokens included); a cached block in a table is a full block of the request's computed
tokens (so no rejected draft is ever hashed); an uncached block's tokens are the
request's tokens at its first positions (a partial tail: a prefix of its block); only
unfinished requests hold blocks, so when all requests are done every block is free.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from workbench.core.block_pool import BlockPool, KVCacheBlock
from workbench.core.kv_events import BlockWritten, KVEvent
from workbench.core.prefix_memory import PrefixMemory
from workbench.core.kv_state import KVState, block_state
from workbench.core.kv_cache_utils import hash_block_run, hash_block_tokens
from workbench.request import Request


def freed_block_order(blocks: Sequence[KVCacheBlock]) -> list[KVCacheBlock]:
    """The order in which one request's released blocks join the free queue's back: tail
    first (vLLM's rule). A request's last blocks are the least likely to be shared by
    another prompt, so they are evicted before its first ones, which keep a common prefix
    cached longest. (The self-grading eviction exercise uses this as its reference.)"""
    return blocks[::-1]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, in tokens, counted once per admission of a request."""

    requests: int = 0
    queries: int = 0  # tokens of the admitted requests
    hits: int = 0  # of those, tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self.requests = self.queries = self.hits = 0


@dataclass
class KVCacheStats:
    """What the KV cache did between two :meth:`KVCacheManager.make_stats` calls: blocks
    handed out, released (ref_count fell to 0) and evicted (a cached block's hash dropped to
    serve an allocation), and prefix-cache queries and hits in tokens (once per admission)."""

    num_blocks_allocated: int = 0
    num_blocks_freed: int = 0
    num_blocks_evicted: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    def __add__(self, other: KVCacheStats) -> KVCacheStats:
        """Field by field (once per step: spelled out, no ``fields()`` reflection)."""
        return KVCacheStats(self.num_blocks_allocated + other.num_blocks_allocated,
                            self.num_blocks_freed + other.num_blocks_freed,
                            self.num_blocks_evicted + other.num_blocks_evicted,
                            self.prefix_cache_queries + other.prefix_cache_queries,
                            self.prefix_cache_hits + other.prefix_cache_hits)


class KVCacheManager:
    """Block tables of the requests over one pool of ``num_blocks`` blocks of ``block_size`` slots.

    ``blocks[i]`` is the live :class:`KVCacheBlock` ``i`` (block_id, ref_count, block_hash,
    token_ids, owners). With ``enable_prefix_caching`` off no hash is computed and no block
    is shared. With ``record_events`` the pool logs every change (``take_events()``), so a
    :class:`~workbench.core.kv_state.KVState` taken by :meth:`snapshot` can be rolled forward.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, record_events=record_events)
        self._events = self.pool._events  # the pool's event list (the same list for its lifetime), or None
        self.prefix_cache_stats = PrefixCacheStats()  # cumulative since the last reset
        self._stats = KVCacheStats()  # since the last make_stats()
        self._tables: dict[str, list[KVCacheBlock]] = {}
        # The same tables as block ids, rebuilt only when a table grows (every scheduled
        # chunk carries its request's table; most decode steps do not grow it).
        self._table_ids: dict[str, tuple[int, ...]] = {}
        self._num_filled: dict[str, int] = {}  # leading full blocks whose tokens are recorded
        # The last prefix lookup (request, pool.cache_version, num_tokens, hits): a waiting
        # request that does not fit is looked up again every step until the cache changes.
        self._last_lookup: tuple[Request, int, int, list[KVCacheBlock]] | None = None
        #: Remembers evictions and cached contents to explain prefix misses (None: not kept).
        self.prefix_memory: PrefixMemory | None = None

    def attach_prefix_memory(self, memory: PrefixMemory) -> None:
        """Keep ``memory`` informed of every eviction and newly cached block from now on."""
        self.prefix_memory = self.pool.prefix_memory = memory

    # ----------------------------------------------------------------- views
    @property
    def blocks(self) -> list[KVCacheBlock]:
        return self.pool.blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0 (cached-but-unused blocks count: they are evictable)."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one request, in [0, 1]."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently findable by the prefix cache (in use or not)."""
        return len(self.pool.cached)

    def block_table(self, request_id: str) -> list[int]:
        """Physical block ids of the request, in logical order ([] when it holds none)."""
        return list(self._table_ids.get(request_id, ()))

    def blocks_of(self, request_id: str) -> tuple[KVCacheBlock, ...]:
        """The request's blocks, in logical order (empty when it holds none)."""
        return tuple(self._tables.get(request_id, ()))

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """``block_table`` as a tuple (what a ScheduledRequest carries); O(1)."""
        return self._table_ids.get(request_id, ())

    @property
    def block_ids_by_request(self) -> Mapping[str, tuple[int, ...]]:
        """Request id -> ``block_ids``, for a caller that reads many in a row (the scheduler's
        decode path); read-only: only this manager changes it. A table of ``k`` ids holds
        ``k * block_size`` slots: a request whose tokens fit them needs no allocation."""
        return self._table_ids

    def make_stats(self) -> KVCacheStats:
        """The counts since the previous call (vLLM: ``make_prefix_cache_stats``), and reset."""
        stats, self._stats = self._stats, KVCacheStats()
        return stats

    def take_events(self) -> tuple[KVEvent, ...]:
        """The pool's block events since the previous call (empty unless ``record_events``)."""
        return self.pool.take_events()

    def snapshot(self) -> KVState:
        """The pool as it is now, as an immutable :class:`KVState` (O(num_blocks))."""
        return KVState.capture(self.pool, self._table_ids, self.block_size)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    # ----------------------------------------------------------- prefix cache
    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its tokens (the first
        block's hash mixes in ``request.cache_salt``, every block's its adapter's name).

        O(new full blocks); a no-op when prefix caching is off.
        """
        bs = self.block_size
        hashes = request.block_hashes
        num_full = (len(request.prompt_token_ids) + len(request.output_token_ids)) // bs
        if len(hashes) >= num_full or not self.enable_prefix_caching:
            return
        first = len(hashes)
        tokens = request.token_ids_slice(first * bs, num_full * bs)  # the new full blocks' tokens
        if num_full - first == 1 and first and request.lora_request is None:
            # one block past the first (a decode's), no adapter: no extra keys to encode
            hashes.append(hash_block_tokens(hashes[-1], tokens))
            return
        hashes += hash_block_run(hashes[-1] if first else None, tokens, bs, first,
                                 request.cache_salt, request.lora_name)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of the request's leading full blocks found in the cache, and the
        number of tokens they hold. Capped at ``(num_tokens - 1) // block_size`` blocks so at
        least the last known token is computed (and sampled from). A request that asks for
        prompt logprobs gets no hit: its whole prompt must be computed (as vLLM); so does a pooling
        request that skips reading the cache (``skip_reading_prefix_cache``). Changes no
        state. Asked again for the same request while the cache's content is unchanged (a
        waiting request that does not fit yet), it answers in O(hits) from the last lookup."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        if request.pooling_params is not None and request.pooling_params.skip_reading_prefix_cache:
            return [], 0  # MEAN / CLS / ALL pooling reads every position's hidden state
        bs = self.block_size
        num_tokens = request.num_tokens
        last = self._last_lookup
        if last is not None and last[0] is request and last[1] == self.pool.cache_version and last[2] == num_tokens:
            return list(last[3]), len(last[3]) * bs
        self.update_block_hashes(request)
        max_blocks = min((num_tokens - 1) // bs, len(request.block_hashes))
        hits: list[KVCacheBlock] = []
        for i in range(max_blocks):
            block = self.pool.get_cached_block(request.block_hashes[i])
            if block is None or block.token_ids != tuple(request.token_ids_slice(i * bs, (i + 1) * bs)):
                break
            hits.append(block)
        self._last_lookup = (request, self.pool.cache_version, num_tokens, hits)
        return list(hits), len(hits) * bs

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks and the stats. False (nothing done) while blocks are in use."""
        if not self.pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats.reset()
        return True

    # ------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Grow the request's table to hold ``num_computed_tokens + hits + num_new_tokens`` tokens.

        ``new_computed_blocks`` (from :meth:`get_computed_blocks`) are only accepted for a
        request that holds no blocks yet. Returns the newly allocated blocks (hits excluded),
        or None -- with no state changed -- when the free blocks cannot cover them.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}.")
        rid = request.request_id
        table = self._tables.get(rid)
        bs = self.block_size
        total = request.num_computed_tokens + num_new_tokens
        if table is not None:  # a scheduled request grows its table
            if new_computed_blocks:
                raise ValueError(f"request {rid!r} already holds blocks; prefix hits apply only at admission.")
            num_new_blocks = cdiv(total, bs) - len(table)
            if num_new_blocks <= 0:
                return []  # a decode step inside the tail block
            if num_new_blocks > self.pool.num_free_blocks:
                return None
            new_blocks = self._take_new_blocks(rid, num_new_blocks)
            table.extend(new_blocks)
            self._table_ids[rid] += tuple([b.block_id for b in new_blocks])  # the ids held so far stay
            return new_blocks
        # admission: the prefix hits, then new blocks for the rest
        hits = list(new_computed_blocks or ())
        num_new_blocks = cdiv(total, bs)
        num_hits_from_free = sum(b.ref_count == 0 for b in hits) if hits else 0
        if num_new_blocks + num_hits_from_free > self.pool.num_free_blocks:
            return None
        table = self._tables[rid] = hits
        self._num_filled[rid] = len(hits)
        if self.enable_prefix_caching:
            total_stats, step_stats = self.prefix_cache_stats, self._stats
            total_stats.requests += 1
            total_stats.queries += request.num_tokens
            total_stats.hits += len(hits) * bs
            step_stats.prefix_cache_queries += request.num_tokens
            step_stats.prefix_cache_hits += len(hits) * bs
        if hits:
            self.pool.touch(hits, rid)
        new_blocks = self._take_new_blocks(rid, num_new_blocks) if num_new_blocks else []
        table += new_blocks
        self._table_ids[rid] = tuple([b.block_id for b in table])
        return new_blocks

    def _take_new_blocks(self, request_id: str, n: int) -> list[KVCacheBlock]:
        """``n`` blocks from the pool for ``request_id``, counted in the step's stats."""
        pool = self.pool
        num_cached = len(pool.cached)  # only evictions shrink it here
        new_blocks = pool.get_new_blocks(n, request_id)
        self._stats.num_blocks_allocated += n
        self._stats.num_blocks_evicted += num_cached - len(pool.cached)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Record the tokens now held by the request's blocks after a step computed them; with
        prefix caching on, newly full blocks enter the cache, and ``block_hashes`` covers every
        full block of the request's known tokens (the ones this step sampled included, as
        vLLM hashes on append). O(tokens of the tail block + newly full blocks).

        A partial tail block's ``token_ids`` are always the request's tokens at its first
        positions (only this method writes them, from the request's own tokens, and a tail is
        never shared), so a decode that computed one more token into it extends that tuple by
        the one token instead of slicing the tail again."""
        bs = self.block_size
        output = request.output_token_ids
        num_prompt = len(request.prompt_token_ids)
        if len(request.block_hashes) < (num_prompt + len(output)) // bs:  # a known block filled up
            self.update_block_hashes(request)
        rid = request.request_id
        table = self._tables[rid]
        num_full = num_computed_tokens // bs
        if num_full > self._num_filled[rid]:  # once per block_size tokens of a decode
            self._fill_blocks(request, table, num_full)
        num_tail = num_computed_tokens - num_full * bs
        if num_tail:  # the tail block's tokens, as BlockPool.write_tokens records them (inlined: once per decode)
            block = table[num_full]
            written = block.token_ids
            if len(written) == num_tail - 1 and num_computed_tokens > num_prompt:  # one more generated token
                tail = written + (output[num_computed_tokens - 1 - num_prompt],)
            else:
                tail = tuple(request.token_ids_slice(num_full * bs, num_computed_tokens))
            block.token_ids = tail
            if self._events is not None:
                self._events.append(BlockWritten(block.block_id, tail))

    def _fill_blocks(self, request: Request, table: list[KVCacheBlock], num_full: int) -> None:
        """``cache_blocks``' blocks that became full: from the first not yet recorded up to
        ``num_full``, they enter the prefix cache (and the prefix memory), or, with caching
        off, have their tokens written."""
        rid, bs = request.request_id, self.block_size
        filled = self._num_filled[rid]
        flat = request.token_ids_slice(filled * bs, num_full * bs)
        if num_full - filled == 1:  # a decode's block filled up
            tokens = [tuple(flat)]
        else:
            tokens = [tuple(flat[i:i + bs]) for i in range(0, len(flat), bs)]  # one tuple per block
        if not self.enable_prefix_caching:
            for block, block_tokens in zip(table[filled:num_full], tokens):
                self.pool.write_tokens(block, block_tokens)
        elif len(tokens) == 1:  # one block: no run to split (most calls)
            hashes = request.block_hashes
            self.pool.cache_full_block(table[filled], hashes[filled], hashes[filled - 1] if filled else None,
                                       tokens[0], bs)
        else:
            hashes = request.block_hashes
            self.pool.cache_full_blocks(
                table[filled:num_full], hashes[filled:num_full],
                hashes[filled - 1] if filled else None, tokens, bs,
            )
        if self.prefix_memory is not None and self.enable_prefix_caching:
            self.prefix_memory.stored(request, filled, tokens)
        self._num_filled[rid] = num_full

    def free_unneeded_blocks(self, request: Request) -> None:
        """Release the table's blocks past ``ceil(num_computed_tokens / block_size)``: after
        speculative decoding they held only rejected draft tokens (never cached; the tail
        block kept is overwritten from its first rejected slot by the next step)."""
        rid = request.request_id
        table = self._tables[rid]
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if len(table) <= keep:
            return
        surplus = table[keep:]
        del table[keep:]
        self._table_ids[rid] = tuple(b.block_id for b in table)
        self._release(surplus, rid)

    def free(self, request: Request) -> None:
        """Release every block of the request (tail first into the eviction order)."""
        table = self._tables.pop(request.request_id, None)
        if table is None:
            return
        del self._num_filled[request.request_id]
        del self._table_ids[request.request_id]
        self._release(table, request.request_id)

    def _release(self, blocks: list[KVCacheBlock], rid: str) -> None:
        """Drop ``rid``'s references on ``blocks`` (tail first) and count the blocks that
        became free (read off the pool's ``num_freed``, not by a second pass)."""
        pool = self.pool
        num_freed = pool.num_freed
        pool.free_blocks(freed_block_order(blocks), rid)
        self._stats.num_blocks_freed += pool.num_freed - num_freed

    # ------------------------------------------------------------- invariants
    def check_invariants(
        self, requests: Iterable[Request], num_scheduled_tokens: Mapping[str, int] | None = None
    ) -> None:
        """Raise AssertionError naming the first broken invariant.

        ``requests`` are all unfinished requests; ``num_scheduled_tokens`` (request id ->
        tokens) is given between ``schedule()`` and ``update_from_output()``, when tables
        already cover the scheduled tokens.
        """
        self.pool.check_invariants(self.block_size)
        by_id = {r.request_id: r for r in requests}
        scheduled = num_scheduled_tokens or {}
        for rid, table in self._tables.items():
            ids = [b.block_id for b in table]
            assert rid in by_id, f"blocks {ids} are held by {rid!r}, which is not an unfinished request"
            req = by_id[rid]
            tokens = req.num_computed_tokens + scheduled.get(rid, 0)
            assert len(table) == cdiv(tokens, self.block_size), (
                f"request {rid!r}: block table {ids} has {len(table)} blocks but "
                f"{tokens} tokens need {cdiv(tokens, self.block_size)} (block_size={self.block_size})"
            )
            assert len(set(ids)) == len(ids), f"request {rid!r}: block table {ids} repeats a block"
            assert list(self._table_ids[rid]) == ids, f"request {rid!r}: id list {self._table_ids[rid]} != {ids}"
            for i, b in enumerate(table):
                assert rid in b._owners, f"request {rid!r} holds block {b.block_id} without owning it"
                if b.block_hash is not None:  # only full blocks of computed (accepted) tokens
                    assert (i + 1) * self.block_size <= tokens and b.token_ids == tuple(
                        req.token_ids_slice(i * self.block_size, (i + 1) * self.block_size)), (
                        f"request {rid!r}: cached block {b.block_id} at position {i} is not a full "
                        f"block of its computed tokens (num_computed_tokens={req.num_computed_tokens})"
                    )
                else:  # what cache_blocks extends: the request's tokens at the block's first positions
                    start = i * self.block_size
                    assert b.token_ids == tuple(req.token_ids_slice(start, start + len(b.token_ids))), (
                        f"request {rid!r}: block {b.block_id} at position {i} holds tokens "
                        f"{list(b.token_ids)}, not the request's"
                    )
                if b.block_hash is not None and i < len(req.block_hashes):
                    assert b.block_hash == req.block_hashes[i], (
                        f"request {rid!r}: block {b.block_id} at position {i} has another prefix's hash"
                    )
        for b in self.pool.blocks:
            for owner in b._owners:
                assert owner in self._tables and any(x is b for x in self._tables[owner]), (
                    f"block {b.block_id} lists owner {owner!r} whose table lacks it"
                )

    # ------------------------------------------------------------------ repr
    def __repr__(self) -> str:
        return (
            f"KVCacheManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.num_free_blocks}, cached={self.num_cached_blocks}, "
            f"usage={self.usage:.1%}, requests={len(self._tables)}, "
            f"prefix_caching={self.enable_prefix_caching})"
        )

    _HTML_MAX_BLOCKS = 1024

    def _repr_html_(self) -> str:
        """A grid of blocks: id and ref count; colour = free / cached / in use / shared."""
        colours = {"free": "#eeeeee", "cached": "#c8e6c9", "used": "#ffcc80", "shared": "#ef9a9a"}
        cells = []
        for b in self.pool.blocks[: self._HTML_MAX_BLOCKS]:
            kind = block_state(b)
            title = (
                f"block {b.block_id}: ref_count {b.ref_count}, {len(b.token_ids)} tokens"
                + (f", hash {b.block_hash.hex()[:12]}" if b.block_hash else "")
                + (f", owners {', '.join(b._owners)}" if b._owners else "")
            )
            cells.append(
                f'<div title="{html.escape(title)}" style="background:{colours[kind]};'
                f'width:34px;height:28px;font-size:10px;text-align:center;line-height:13px;'
                f'border:1px solid #999">{b.block_id}<br>{b.ref_count}</div>'
            )
        more = self.num_blocks - self._HTML_MAX_BLOCKS
        legend = " ".join(
            f'<span style="background:{c};padding:0 4px;border:1px solid #999">{k}</span>'
            for k, c in colours.items()
        )
        return (
            f"<div><b>KVCacheManager</b> {self.num_blocks} blocks x {self.block_size} slots, "
            f"{self.num_free_blocks} free, {self.num_cached_blocks} cached, usage {self.usage:.1%} "
            f"&nbsp; {legend} &nbsp; (cell: block id / ref count)"
            f'<div style="display:flex;flex-wrap:wrap;gap:2px;margin-top:4px">{"".join(cells)}</div>'
            + (f"<i>... {more} more blocks</i>" if more > 0 else "")
            + "</div>"
        )
