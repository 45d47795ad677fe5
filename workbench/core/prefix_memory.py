"""PrefixMemory: what the prefix cache remembers so that a miss can be explained.

Two bounded maps, written as the cache works and read only to explain a lookup:

* ``evictions``: block hash -> (step, request id) -- the step whose allocation dropped the
  hash from the cache, and the request the freed block was handed to;
* the content index: a block's *content key* (its tokens chained with its predecessors',
  with no ``cache_salt`` and no adapter mixed in) -> the (cache_salt, LoRA name) it was last
  cached under, so a miss on the same tokens cached under another salt or adapter is named.

A content key is the block hash the same tokens get without a salt or an adapter (the
sha256 chain of :mod:`workbench.core.kv_cache_utils`), so a plain request's block hash *is*
its content key: recording one of its blocks is one map entry, no hashing. A salted or
adapted request's keys are hashed from its tokens (chained on the nearest key remembered in
a memo of its own, block hash -> content key).

Each map (the memo too) keeps at most ``capacity`` entries, the oldest dropped first (a long
run never grows them past that). Costs: O(1) per eviction and per newly cached block of a
plain request, one sha256 per newly cached block of a salted or adapted one.
"""

from __future__ import annotations

from collections import OrderedDict

from workbench.core.kv_cache_utils import hash_block_run
from workbench.request import Request


class PrefixMemory:
    """Evictions and cached contents, bounded (see the module docstring)."""

    def __init__(self, block_size: int, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}.")
        self.block_size = block_size
        self.capacity = capacity
        #: The step now being scheduled (the explainer advances it after each step).
        self.step = 0
        # OrderedDicts, not dicts: dropping a plain dict's oldest key with next(iter(d)) walks
        # the tombstones its earlier deletions left, O(deleted) per drop.
        self.evictions: OrderedDict[bytes, tuple[int, str]] = OrderedDict()
        # a salted or adapted request's block hash -> its content key (a memo)
        self._content_of: OrderedDict[bytes, bytes] = OrderedDict()
        # content key -> (salt, lora)
        self._stored_under: OrderedDict[bytes, tuple[str | None, str | None]] = OrderedDict()

    def evicted(self, block_hash: bytes, for_request: str) -> None:
        """A cached block lost ``block_hash`` to serve ``for_request`` in the current step."""
        evictions = self.evictions
        evictions[block_hash] = (self.step, for_request)
        evictions.move_to_end(block_hash)  # the newest eviction is kept last
        if len(evictions) > self.capacity:  # one entry more at most
            evictions.popitem(last=False)

    def content_key(self, request: Request, index: int) -> bytes:
        """The content key of the request's block ``index`` (a full block). O(1) for a plain
        request or when the previous block's key is remembered, else O(index)."""
        hashes = request.block_hashes
        if request.cache_salt is None and request.lora_name is None:
            return hashes[index]
        start, key = index, None
        while start > 0:  # back to the nearest remembered key
            key = self._content_of.get(hashes[start - 1]) if start - 1 < len(hashes) else None
            if key is not None:
                break
            start -= 1
        bs = self.block_size
        return hash_block_run(key, request.token_ids_slice(start * bs, (index + 1) * bs), bs, start)[-1]

    def stored(self, request: Request, first: int, tokens: list[tuple[int, ...]]) -> None:
        """The request's full blocks ``first, first + 1, ...`` were just cached (or written);
        ``tokens`` holds each one's token ids (the cache's own tuples, not sliced again). A
        plain request's block hashes are their content keys; a salted or adapted request's
        run is chained on the content key of the block before it (:meth:`content_key`)."""
        hashes = request.block_hashes
        stored_under, under = self._stored_under, (request.cache_salt, request.lora_name)
        if under == (None, None):
            keys = hashes[first:first + len(tokens)]
        else:
            parent = None if first == 0 else self.content_key(request, first - 1)
            flat = [token for block_tokens in tokens for token in block_tokens]
            keys = hash_block_run(parent, flat, self.block_size, first)
            content_of = self._content_of
            for block_hash, key in zip(hashes[first:], keys):
                content_of[block_hash] = key
            while len(content_of) > self.capacity:
                content_of.popitem(last=False)
        for key in keys:
            stored_under[key] = under
        while len(stored_under) > self.capacity:
            stored_under.popitem(last=False)

    def stored_under(self, request: Request, index: int) -> tuple[str | None, str | None] | None:
        """(cache_salt, LoRA name) the request's block ``index``'s tokens were last cached
        under, or None when this content was never cached (as far as remembered)."""
        return self._stored_under.get(self.content_key(request, index))
