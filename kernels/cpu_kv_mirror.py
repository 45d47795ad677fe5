"""KVMirror: each decoding request's K/V kept contiguous beside the paged cache (cpu backend).

The paged cache stays the truth: prefix caching, the block map, KV transfer and every other
kernel use it. The mirror is derived from it. Per layer it holds K and V as
``[rows, capacity, kv_heads * head_dim]``; a decoding request owns a row, and **position ``p``
of the row equals the paged cache row of the request's position ``p`` for every
``p < valid[request]``**. A decode step copies in only what the row lacks (normally the one
position that step just wrote) and SDPA reads the mirror in place, so each cached row is read
once per layer instead of gathered (read, written) and read again.

How :meth:`KVMirror.bind` (once per forward, before the first layer) keeps the invariant:

* a request that finished, or is absent from this forward (preempted, not scheduled), loses
  its row;
* a request whose forward writes positions ``[L - q, L)`` (a decode, a prefill chunk, a
  speculative verify, a position again after rejected drafts) keeps
  ``valid = min(valid, L - q)``;
* a request whose block table changed below ``valid`` (another block for the same positions)
  keeps only the positions of the unchanged leading blocks;
* other cache tensors than last time (reallocation, sleep), another block size, or a forward
  that did not reach every layer (an exception, an interrupt) clear the whole mirror.

Then every decoding request with a row gets positions ``[valid, L)`` copied from the paged
cache, in every layer, after that layer's KV write (:func:`fill`), and ``valid = L``.
Positions at or past a row's length hold zeros (a new row is zeroed) or K/V of the row's own
request: finite, and masked out.

Memory: at most ``budget_bytes`` (:data:`MIRROR_BUDGET_BYTES` by default) over all layers;
rows and capacity grow on demand in steps. A decoding sequence that does not fit (too long,
no row left) takes the gathering path. fp32 caches only (the cpu backend computes in fp32).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

#: Default upper bound of the mirror's memory, all layers, K and V (256 MiB).
MIRROR_BUDGET_BYTES = 256 * 2**20
#: Rows and positions are allocated in steps of these sizes.
ROW_STEP = 32
CAPACITY_STEP = 128
#: The decode rows are re-sorted by length when their order reads this much more (as a share
#: of the sorted order's padded positions).
REPACK_WASTE = 0.25


def cut_rows(lens: list[int], max_groups: int, min_saving: int) -> list[int]:
    """Cut points (exclusive ends) of consecutive rows into at most ``max_groups`` ranges, each
    padded to its longest row: greedily the split that saves the most padding, while a split
    saves at least ``min_saving`` positions."""
    cuts = [len(lens)]
    while len(cuts) < max_groups:
        best, best_at, start = 0, None, 0
        for end in cuts:
            seg = lens[start:end]
            pre = list(itertools.accumulate(seg, max))
            suf = list(itertools.accumulate(reversed(seg), max))[::-1]
            for i in range(1, len(seg)):
                saving = len(seg) * pre[-1] - i * pre[i - 1] - (len(seg) - i) * suf[i]
                if saving > best:
                    best, best_at = saving, start + i
            start = end
        if best_at is None or best < min_saving:
            break
        cuts = sorted(cuts + [best_at])
    return cuts


def padded(lens: list[int], max_groups: int, min_saving: int) -> int:
    """Positions SDPA reads for rows of these lengths cut by :func:`cut_rows`."""
    total, begin = 0, 0
    for end in cut_rows(lens, max_groups, min_saving):
        total += (end - begin) * max(lens[begin:end])
        begin = end
    return total


@dataclass
class MirrorBinding:
    """One forward's use of the mirror: which decode sequences read it, and what to copy in."""

    mirror: KVMirror
    seqs: list[int]  # index of each mirrored decode sequence in the batch
    rows: list[int]  # its mirror row
    lens: list[int]  # its length after this forward
    fill_dest: torch.Tensor  # int64: flat mirror position (row * capacity + p) to copy into
    fill_src: torch.Tensor  # int64: the paged cache slot it copies from
    layers: dict[int, int]  # key cache data_ptr -> layer index
    pending: set = field(default_factory=set)  # layers not yet filled in this forward

    @property
    def num_filled(self) -> int:
        """Positions copied per layer in this forward (one per decode sequence when steady)."""
        return self.fill_dest.numel()


class KVMirror:
    """The mirror (see the module docstring); one per model runner."""

    def __init__(self, budget_bytes: int = MIRROR_BUDGET_BYTES):
        self.budget_bytes = budget_bytes
        self.clear()

    def clear(self) -> None:
        """Forget everything (the next forward copies each sequence in again)."""
        self.k: list[torch.Tensor] = []  # per layer [rows, capacity, kv_heads * head_dim]
        self.v: list[torch.Tensor] = []
        self.caches: tuple = ()
        self.block_size = 0
        self.row_of: dict[str, int] = {}
        self.valid: dict[str, int] = {}
        self.tables = torch.empty(0, 0, dtype=torch.int64)  # per row: the blocks it copied from
        self.last: MirrorBinding | None = None
        self.repacks = 0
        self.checked: tuple = ()  # the layout _repack last judged

    @property
    def num_rows(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1] if self.k else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def _resize(self, rows: int, capacity: int, width: int, layers: int) -> None:
        """Reallocate to ``rows x capacity`` (zeros), keeping what the old tensors held."""
        old_rows, old_cap = self.num_rows, self.capacity
        for name in ("k", "v"):
            new = [torch.zeros(rows, capacity, width) for _ in range(layers)]
            for t, o in zip(new, getattr(self, name)):
                t[:old_rows, :old_cap] = o
            setattr(self, name, new)
        tables = torch.full((rows, -(-capacity // self.block_size)), -1, dtype=torch.int64)
        tables[:self.tables.shape[0], :self.tables.shape[1]] = self.tables
        self.tables = tables

    def bind(self, request_ids, finished, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
             block_tables: torch.Tensor, kv_caches, block_size: int) -> MirrorBinding | None:
        """Update the bookkeeping for one forward (see the module docstring) and return what
        its layers do with the mirror; ``None`` when no sequence reads it."""
        caches = tuple(t for kv in kv_caches for t in kv)
        if (len(caches) != len(self.caches) or any(a is not b for a, b in zip(caches, self.caches))
                or block_size != self.block_size or (self.last is not None and self.last.pending)):
            self.clear()
            self.caches, self.block_size = caches, block_size
        self.last = None
        if not caches or caches[0].dtype != torch.float32:
            return None
        _, _, kv_heads, head_dim = caches[0].shape
        width, layers = kv_heads * head_dim, len(kv_caches)
        present = set(request_ids)
        for rid in [r for r in self.row_of if r not in present or r in finished]:
            del self.row_of[rid], self.valid[rid]
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        used = set(self.row_of.values())
        free = (r for r in range(1 << 30) if r not in used)
        seqs, rows = [], []
        for s, rid in enumerate(request_ids):
            q, length = starts[s + 1] - starts[s], lens[s]
            if rid in self.row_of:  # this forward (re)writes positions [length - q, length)
                self.valid[rid] = min(self.valid[rid], length - q)
            if q == 1:
                if rid not in self.row_of:
                    self.row_of[rid], self.valid[rid] = next(free), 0
                seqs.append(s)
                rows.append(self.row_of[rid])
        if not seqs:
            return None
        def limit(num_rows: int) -> int:  # the longest capacity the budget allows, in steps
            per_row = width * 4 * 2 * layers * CAPACITY_STEP
            return self.budget_bytes // (num_rows * per_row) * CAPACITY_STEP

        new_rows = max(self.num_rows, -(-(max(rows) + 1) // ROW_STEP) * ROW_STEP)
        if limit(new_rows) < self.capacity:  # more rows would not fit at this capacity
            new_rows = self.num_rows
        fitting = [lens[s] for s in seqs if lens[s] <= limit(new_rows)]
        new_cap = max([self.capacity] + [-(-n // CAPACITY_STEP) * CAPACITY_STEP for n in fitting])
        if new_cap and (new_rows, new_cap) != (self.num_rows, self.capacity):
            self._resize(new_rows, new_cap, width, layers)
        # sequences that do not fit take the gathering path and give their row back
        keep = [i for i, s in enumerate(seqs) if rows[i] < self.num_rows and lens[s] <= self.capacity]
        if len(keep) < len(seqs):
            for i in set(range(len(seqs))) - set(keep):
                rid = request_ids[seqs[i]]
                del self.row_of[rid], self.valid[rid]
            seqs, rows = [seqs[i] for i in keep], [rows[i] for i in keep]
            if not seqs:
                return None
        seqs, rows = self._repack(request_ids, seqs, rows, lens)
        new = [r for s, r in zip(seqs, rows) if self.valid[request_ids[s]] == 0]
        if new:  # a row starts as zeros, never as another request's K/V
            idx = torch.tensor(new)
            for t in (*self.k, *self.v):
                t.index_fill_(0, idx, 0.0)
        # keep only the leading blocks that are the same blocks as when they were copied
        row_t, seq_t = torch.tensor(rows), torch.tensor(seqs)
        cols = min(self.tables.shape[1], block_tables.shape[1])
        current = block_tables[seq_t, :cols].long()
        changed = current != self.tables[row_t, :cols]
        first = torch.where(changed.any(1), changed.int().argmax(1), cols)
        valid = torch.minimum(torch.tensor([self.valid[request_ids[s]] for s in seqs]),
                              first * block_size)
        self.tables[row_t, :cols] = current
        target = torch.tensor([lens[s] for s in seqs])
        # positions [valid, target) of each sequence, flattened
        counts = target - valid
        seq_of = torch.repeat_interleave(torch.arange(len(seqs)), counts)
        offset = torch.arange(seq_of.numel()) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        pos = valid[seq_of] + offset
        src = current[seq_of, pos // block_size] * block_size + pos % block_size
        dest = row_t[seq_of] * self.capacity + pos
        for s in seqs:
            self.valid[request_ids[s]] = lens[s]
        self.last = MirrorBinding(
            self, seqs, rows, [lens[s] for s in seqs], dest, src,
            {kc.data_ptr(): i for i, (kc, _) in enumerate(kv_caches)}, set(range(layers)))
        return self.last

    def _repack(self, request_ids, seqs: list[int], rows: list[int], lens: list[int]
                ) -> tuple[list[int], list[int]]:
        """Move the decode sequences' rows to ``0..n-1`` in order of length when their current
        order pads SDPA's groups by more than :data:`REPACK_WASTE` over the sorted order
        (lengths grow together, so the order then holds until requests come and go). Rows of
        requests not decoding in this forward are given up."""
        from workbench.kernels.cpu_attention import MAX_DECODE_GROUPS, MIN_GROUP_SAVING

        layout = (tuple(rows), tuple(request_ids[s] for s in seqs))
        if layout == self.checked:  # same rows as last time: the lengths kept their order
            return seqs, rows
        self.checked = layout
        length_of = {r: lens[s] for s, r in zip(seqs, rows)}
        span = [length_of.get(r, 1) for r in range(min(rows), max(rows) + 1)]
        ideal = sorted(length_of.values())
        if (padded(span, MAX_DECODE_GROUPS, MIN_GROUP_SAVING)
                <= (1 + REPACK_WASTE) * padded(ideal, MAX_DECODE_GROUPS, MIN_GROUP_SAVING)):
            return seqs, rows
        order = sorted(range(len(seqs)), key=lambda i: lens[seqs[i]])
        old = torch.tensor([rows[i] for i in order])
        for t in (*self.k, *self.v):
            t[:len(order)] = t.index_select(0, old)
        self.tables[:len(order)] = self.tables.index_select(0, old)
        members = {request_ids[s] for s in seqs}
        for rid in [r for r in self.row_of if r not in members]:
            del self.row_of[rid], self.valid[rid]
        for new_row, i in enumerate(order):
            self.row_of[request_ids[seqs[i]]] = new_row
        self.repacks += 1
        seqs, rows = [seqs[i] for i in order], list(range(len(order)))
        self.checked = (tuple(rows), tuple(request_ids[s] for s in seqs))
        return seqs, rows


def fill(binding: MirrorBinding, key_cache: torch.Tensor, value_cache: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy this forward's missing positions of this layer from the paged cache into the
    mirror (call after the layer's KV write); returns the layer's mirror K and V
    ``[rows, capacity, kv_heads, head_dim]``."""
    mirror = binding.mirror
    layer = binding.layers[key_cache.data_ptr()]
    num_blocks, block_size, kv_heads, head_dim = key_cache.shape
    out = []
    for cache, store in ((key_cache, mirror.k[layer]), (value_cache, mirror.v[layer])):
        width = kv_heads * head_dim
        if binding.fill_dest.numel():
            rows = cache.view(num_blocks * block_size, width)
            store.view(-1, width).index_copy_(0, binding.fill_dest,
                                              rows.index_select(0, binding.fill_src))
        out.append(store.view(store.shape[0], store.shape[1], kv_heads, head_dim))
    binding.pending.discard(layer)
    return out[0], out[1]
