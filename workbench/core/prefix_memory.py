"""PrefixMemory: what the prefix cache remembers so that a miss can be explained.

Two bounded maps, written as the cache works and read only to explain a lookup:

* ``evictions``: block hash -> (step, request id) -- the step whose allocation dropped the
  hash from the cache, and the request the freed block was handed to;
* the content index: a block's *content key* (its tokens chained with its predecessors',
  with no ``cache_salt`` and no adapter mixed in) -> the (cache_salt, LoRA name) it was last
  cached under, so a miss on the same tokens cached under another salt or adapter is named.

Each map keeps at most ``capacity`` entries, the oldest dropped first (a long run never
grows them past that). Costs: O(1) per eviction, one Python ``hash`` per newly cached block.
"""

from __future__ import annotations

from collections import OrderedDict

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
        self._content_of: OrderedDict[bytes, int] = OrderedDict()  # block hash -> content key
        # content key -> (salt, lora)
        self._stored_under: OrderedDict[int, tuple[str | None, str | None]] = OrderedDict()

    def evicted(self, block_hash: bytes, for_request: str) -> None:
        """A cached block lost ``block_hash`` to serve ``for_request`` in the current step."""
        evictions = self.evictions
        evictions[block_hash] = (self.step, for_request)
        evictions.move_to_end(block_hash)  # the newest eviction is kept last
        if len(evictions) > self.capacity:  # one entry more at most
            evictions.popitem(last=False)

    def content_key(self, request: Request, index: int) -> int:
        """The content key of the request's block ``index`` (a full block): its tokens chained
        with those before it, salt and adapter left out. O(1) when the previous block's key
        is remembered, else O(index)."""
        hashes, bs = request.block_hashes, self.block_size
        start, key = index, 0
        while start > 0:  # back to the nearest remembered key
            known = self._content_of.get(hashes[start - 1]) if start - 1 < len(hashes) else None
            if known is not None:
                key = known
                break
            start -= 1
        for i in range(start, index + 1):
            key = hash((key, tuple(request.token_ids_slice(i * bs, (i + 1) * bs))))
        return key

    def stored(self, request: Request, first: int, tokens: list[tuple[int, ...]]) -> None:
        """The request's full blocks ``first, first + 1, ...`` were just cached (or written);
        ``tokens`` holds each one's token ids (the cache's own tuples, not sliced again). The
        run's parent key is looked up (:meth:`content_key`); each block's key chains on the
        one before."""
        hashes = request.block_hashes
        content_of, stored_under = self._content_of, self._stored_under
        under = (request.cache_salt, request.lora_name)
        key = 0 if first == 0 else content_of.get(hashes[first - 1])  # a key depends on tokens only
        if key is None:
            key = self.content_key(request, first - 1)
        for block_hash, block_tokens in zip(hashes[first:], tokens):
            key = hash((key, block_tokens))
            content_of[block_hash] = key
            stored_under[key] = under
        capacity = self.capacity
        while len(content_of) > capacity:
            content_of.popitem(last=False)
        while len(stored_under) > capacity:
            stored_under.popitem(last=False)

    def stored_under(self, request: Request, index: int) -> tuple[str | None, str | None] | None:
        """(cache_salt, LoRA name) the request's block ``index``'s tokens were last cached
        under, or None when this content was never cached (as far as remembered)."""
        return self._stored_under.get(self.content_key(request, index))
