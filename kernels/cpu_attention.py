"""Paged attention for CPU tensors, built for whole batches (the ``"cpu"`` backend).

Contract: :func:`workbench.kernels.reference.paged_attention` (same signature and result up to
floating-point rounding), plus an optional ``plan``.

Where the reference's time goes on a CPU is moving the paged cache around (gathers, permuted
copies for ``einsum``, masked copies), not arithmetic. This path moves each cached K/V byte
once per layer:

* **Few query tokens a sequence** (a step of decodes or speculative verify chunks: see
  :func:`~workbench.kernels.cpu_few_tokens_attention.takes_step`, fp32): one numba call of
  :mod:`workbench.kernels.cpu_few_tokens_attention` per layer reads K/V through the block
  tables in place; the plan only holds the step's layout for it. Everything below is for
  the other steps (prefill chunks, and at several threads many long decodes).
* **Plan once per forward.** :func:`plan_attention` turns the block tables and lengths into
  the index tensors every layer reuses (:class:`AttentionPlan`): decode sequences (one query
  each) are sorted by length and cut into tiles of similar length of at most :func:`tile_rows`
  gathered positions, so padding to the tile's longest sequence stays small; for each tile,
  the cache slot of every position and the causal/window mask. A padding position reads the
  sequence's own last slot (written by this forward, so never garbage: a slot past a length
  may hold anything, even NaN) and is masked out.
* **Decode tiles.** One ``index_select`` of cache rows per tile gathers K and V into
  ``[seqs, len, kv_heads, head_dim]`` buffers small enough to stay in the core's cache; then
  one ``scaled_dot_product_attention`` (its fused CPU kernel reads the strided
  ``[seqs, kv_heads, len, head_dim]`` view, no copy) reads them back from there, where the
  query heads sharing a KV head are that head's query rows: GQA without repeating K/V. The
  decode queries are gathered, and their outputs scattered, once per layer for every tile.
  Each op is a parallel region that a busy machine can make wait for a descheduled thread:
  tiles trade a few more of them for memory traffic (measured in ``kernels/RESULTS.md``).
* **Prefill chunks** (more than one query token) go through
  ``scaled_dot_product_attention`` (its fused CPU kernel: 4-D inputs, K/V repeated per query
  head) one sequence at a time, over the gathered context with a bottom-right-aligned causal
  mask (plain ``is_causal`` when the chunk is the whole context). A short chunk (at most
  ``SHORT_CHUNK`` tokens: a speculative verify chunk) keeps K/V unrepeated (``enable_gqa``).

Math is fp32, as in the reference. :func:`write_kv_cache` and :func:`rotary_embedding` are one
numba call each for fp32 tensors (:mod:`workbench.kernels.cpu_rope_kv`); without numba, the
reference's scatter in two ``index_copy_`` calls and the reference's RoPE with the cos/sin
rows of the forward's positions gathered once, into the plan, for every layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from workbench.kernels import cpu_few_tokens_attention, cpu_rope_kv

#: Gathered positions per decode tile and torch thread (a longer sequence is a tile of its
#: own). A decode layer is bound by moving cached K/V rows: gathered a tile at a time, the rows
#: SDPA reads back are still in the cores' caches (384 KB of K and V a thread at 384-byte
#: rows); one gather of a whole step's decodes went out to memory and back. Measured best at
#: 1024 with 1 thread and 2048 (this times 2) with 2 (see kernels/RESULTS.md).
TILE_ROWS_PER_THREAD = 1024


def tile_rows() -> int:
    """Gathered positions per decode tile under the current torch thread count."""
    return TILE_ROWS_PER_THREAD * torch.get_num_threads()


#: Chunks of at most this many query tokens (a speculative verify chunk: k + 1) keep one K/V
#: head per group of query heads (SDPA's ``enable_gqa``): repeating K/V costs them more than
#: their attention.
SHORT_CHUNK = 16


@dataclass
class DecodeGroup:
    """Decode sequences padded to one length: rows ``[start, end)`` of the plan's
    ``decode_rows``, their cache slots and masks."""

    start: int
    end: int
    slots: torch.Tensor  # int64 [n * length]: cache slot of each position (padding: the last one)
    length: int  # positions per sequence after padding: the group's longest sequence
    seq_lens: torch.Tensor  # int64 [n]
    masks: dict = field(default_factory=dict)  # sliding_window -> additive fp32 [n, 1, 1, L]


@dataclass
class PrefillChunk:
    """One sequence with several new tokens: query rows [q_start, q_end), its cache slots."""

    q_start: int
    q_end: int
    seq_len: int
    slots: torch.Tensor  # int64 [seq_len]: cache slot of each position
    masks: dict = field(default_factory=dict)  # sliding_window -> additive fp32 [q_len, seq_len]


@dataclass
class AttentionPlan:
    """Everything about a batch's layout that does not depend on the layer (built once)."""

    block_size: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    #: int64 [decodes]: the query row (== token index) of every decode sequence, by length
    decode_rows: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    #: "k"/"v" -> gather buffer, grown to the largest tile or chunk and reused by every tile,
    #: chunk and layer (so that it stays in the core's cache)
    buffers: dict = field(default_factory=dict)
    #: (cos_sin_cache, positions) -> (cos, signed sin) [num_tokens, 1, head_dim] (see
    #: :func:`rotary_embedding`); filled by the first layer, reused by the others.
    rotary: dict = field(default_factory=dict)
    #: a step of few query tokens: its layout for one call per layer of
    #: :mod:`workbench.kernels.cpu_few_tokens_attention` (then no groups, chunks or buffers)
    few_tokens: cpu_few_tokens_attention.StepLayout | None = None

    def __repr__(self) -> str:
        if self.few_tokens is not None:
            return "AttentionPlan(few tokens: one numba call)"
        sizes = [(g.end - g.start, g.length) for g in self.decode_groups]
        return (f"AttentionPlan(decode_groups(seqs, length)={sizes}, "
                f"prefills={[(p.q_end - p.q_start, p.seq_len) for p in self.prefills]})")


def _cut_tiles(lens: list[int]) -> list[int]:
    """Cut points (exclusive ends) over ascending lengths: each tile takes the next sequences
    while (its sequences) x (its longest length) stays within :func:`tile_rows`."""
    cuts, start, budget = [], 0, tile_rows()
    for i, length in enumerate(lens):
        if i > start and (i + 1 - start) * length > budget:
            cuts.append(i)
            start = i
    return cuts + [len(lens)] if lens else []


def plan_attention(block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                   seq_lens: torch.Tensor, block_size: int) -> AttentionPlan:
    """The per-forward plan (see the module docstring); ``block_size`` is the cache's. A step
    of few query tokens (:func:`~workbench.kernels.cpu_few_tokens_attention.takes_step`)
    needs none: its plan only says so."""
    step = cpu_few_tokens_attention.layout(block_tables, query_start_loc, seq_lens)
    if cpu_few_tokens_attention.takes_step(step):
        return AttentionPlan(block_size, [], [], few_tokens=step)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes, prefills = [], []
    for s, seq_len in enumerate(lens):
        q_len = starts[s + 1] - starts[s]
        if q_len == 1:
            decodes.append(s)
        elif q_len > 1:
            slots = _slots(block_tables[s:s + 1], torch.arange(seq_len)[None], block_size)
            prefills.append(PrefillChunk(starts[s], starts[s + 1], seq_len, slots.view(-1)))
    decodes.sort(key=lambda s: lens[s])
    groups = []
    if decodes:
        group_lens = torch.tensor([lens[s] for s in decodes], dtype=torch.int64)
        longest = lens[decodes[-1]]
        # positions past a length read the sequence's last slot (written by this very forward,
        # so never garbage) and are masked out
        pos = torch.minimum(torch.arange(longest)[None, :], (group_lens - 1)[:, None])
        slots = _slots(block_tables[torch.tensor(decodes)], pos, block_size)
        visible = _additive((torch.arange(longest)[None, :] < group_lens[:, None])[:, None, None, :])
        begin = 0
        for end in _cut_tiles([lens[s] for s in decodes]):
            length = lens[decodes[end - 1]]
            groups.append(DecodeGroup(
                begin, end, slots=slots[begin:end, :length].reshape(-1), length=length,
                seq_lens=group_lens[begin:end], masks={None: visible[begin:end, ..., :length]}))
            begin = end
    return AttentionPlan(block_size, groups, prefills,
                         torch.tensor([starts[s] for s in decodes], dtype=torch.int64))


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each position: ``tables[i, p // block_size] * block_size + p % block_size``,
    as a gather from every slot of the tables' blocks (torch's integer ``//`` and ``%`` cost
    ~80 us each on a decode batch; this costs ~10 us)."""
    tables = tables[:, :-(-(int(positions.max()) + 1) // block_size)].long()
    every = (tables[:, :, None] * block_size + torch.arange(block_size)).view(tables.shape[0], -1)
    return every.expand(positions.shape[0], -1).gather(1, positions)


def _additive(visible: torch.Tensor) -> torch.Tensor:
    """A bool mask (True = visible) as SDPA's additive fp32 form (0 / -inf): what SDPA would
    convert a bool mask to on every call, converted once per plan."""
    return torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))


def _decode_mask(group: DecodeGroup, sliding_window: int | None) -> torch.Tensor:
    """Additive [n, 1, 1, L]: the cache positions each sequence's query sees (0 = visible)."""
    if sliding_window not in group.masks:
        pos = torch.arange(group.length)
        q_pos = (group.seq_lens - 1)[:, None]
        visible = (pos[None, :] <= q_pos) & (pos[None, :] > q_pos - sliding_window)
        group.masks[sliding_window] = _additive(visible[:, None, None, :])
    return group.masks[sliding_window]


@functools.lru_cache(maxsize=SHORT_CHUNK)
def _causal_tail(q_len: int) -> torch.Tensor:
    """Additive [q_len, q_len]: -inf above the diagonal (a short chunk's own keys)."""
    return _additive(torch.ones(q_len, q_len, dtype=torch.bool).tril_())


def _prefill_mask(chunk: PrefillChunk, sliding_window: int | None) -> torch.Tensor:
    """Additive [q_len, seq_len]: causal, aligned bottom-right (the chunk's queries are the
    sequence's last positions), within the window if any. A short chunk without a window (a
    verify chunk, every speculative step) is zeros with the cached :func:`_causal_tail`
    written into its last columns: two ops instead of six."""
    if sliding_window not in chunk.masks:
        q_len = chunk.q_end - chunk.q_start
        if sliding_window is None and q_len <= SHORT_CHUNK:
            mask = torch.zeros(q_len, chunk.seq_len)
            mask[:, chunk.seq_len - q_len:] = _causal_tail(q_len)
            chunk.masks[None] = mask
            return mask
        q_pos = torch.arange(chunk.seq_len - q_len, chunk.seq_len)[:, None]
        k_pos = torch.arange(chunk.seq_len)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        chunk.masks[sliding_window] = _additive(visible)
    return chunk.masks[sliding_window]


def _gather(cache: torch.Tensor, slots: torch.Tensor, buffers: dict, name: str) -> torch.Tensor:
    """The cache rows at ``slots`` as [len(slots), kv_heads, head_dim] fp32, written into the
    front of a buffer kept in ``buffers`` under ``name`` (valid until the next gather).

    Gathering rows of the cache viewed as 2-D [slots, kv_heads * head_dim] is several times
    faster than gathering from the 4-D view."""
    num_blocks, block_size, kv_heads, head_dim = cache.shape
    rows = cache.view(num_blocks * block_size, kv_heads * head_dim)
    buf = buffers.get(name)
    if (buf is None or buf.dtype != cache.dtype or buf.shape[0] < slots.numel()
            or buf.shape[1] != rows.shape[1]):
        buf = buffers[name] = rows.new_empty((slots.numel(), rows.shape[1]))
    buf = buf[:slots.numel()]
    torch.index_select(rows, 0, slots, out=buf)
    return buf.view(-1, kv_heads, head_dim).float()


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over a paged cache; see the module docstring.

    ``plan``: :func:`plan_attention` of these block tables and lengths, shared by the layers
    of one forward (built here when omitted)."""
    if softcap is not None:  # rare (Gemma-style models): the reference handles it
        from workbench.kernels import reference

        return reference.paged_attention(query, key_cache, value_cache, block_tables,
                                         query_start_loc, seq_lens, scale,
                                         sliding_window=sliding_window, out=out, softcap=softcap)
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if plan is None:
        plan = plan_attention(block_tables, query_start_loc, seq_lens, block_size)
    if plan.few_tokens is not None:
        if cpu_few_tokens_attention.eligible(query, key_cache, value_cache):
            return cpu_few_tokens_attention.paged_attention(
                query, key_cache, value_cache, plan.few_tokens, scale,
                sliding_window=sliding_window, out=out)
        from workbench.kernels import reference  # other dtypes: rare on the CPU

        return reference.paged_attention(query, key_cache, value_cache, block_tables,
                                         query_start_loc, seq_lens, scale,
                                         sliding_window=sliding_window, out=out)
    if out is None:
        out = torch.empty_like(query)
    if plan.decode_groups:
        # the query heads sharing a KV head are that head's "query rows": GQA without repeats
        q = query.index_select(0, plan.decode_rows).float().view(-1, num_kv_heads, group, head_dim)
        results = []
        for g in plan.decode_groups:
            n = g.end - g.start
            k = _gather(key_cache, g.slots, plan.buffers, "k").view(n, g.length, num_kv_heads, head_dim)
            v = _gather(value_cache, g.slots, plan.buffers, "v").view(n, g.length, num_kv_heads, head_dim)
            # SDPA reads the strided [n, kv_heads, length, head_dim] views as they are
            results.append(F.scaled_dot_product_attention(
                q[g.start:g.end], k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=_decode_mask(g, sliding_window), scale=scale))
        out.index_copy_(0, plan.decode_rows,
                        torch.cat(results).view(-1, num_q_heads, head_dim).to(out.dtype))
    for p in plan.prefills:
        q_len = p.q_end - p.q_start
        k = _gather(key_cache, p.slots, plan.buffers, "k").transpose(0, 1)  # [kv_heads, L, D]
        v = _gather(value_cache, p.slots, plan.buffers, "v").transpose(0, 1)
        short = q_len <= SHORT_CHUNK
        if group > 1 and not short:  # one K/V head per query head: SDPA's fused CPU kernel
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        q = query[p.q_start:p.q_end].float().transpose(0, 1)  # [q_heads, q_len, D]
        if q_len == p.seq_len and sliding_window is None:
            mask, causal = None, True
        else:
            mask, causal = _prefill_mask(p, sliding_window), False
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                           is_causal=causal, scale=scale,
                                           enable_gqa=group > 1 and short)[0]
        out[p.q_start:p.q_end] = o.transpose(0, 1).to(out.dtype)
    return out


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """:func:`workbench.kernels.reference.write_kv_cache`: one numba call for fp32 tensors
    (:mod:`workbench.kernels.cpu_rope_kv`), else two ``index_copy_`` when no slot is -1
    (every engine step), else the reference."""
    if (key.dtype is value.dtype is key_cache.dtype is value_cache.dtype is torch.float32
            and key_cache.is_contiguous() and value_cache.is_contiguous() and cpu_rope_kv.available()):
        return cpu_rope_kv.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    if key.shape[0] == 0 or bool((slot_mapping < 0).any()):
        from workbench.kernels import reference

        return reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    num_blocks, block_size, kv_heads, head_dim = key_cache.shape
    slots = slot_mapping.long()
    for src, cache in ((key, key_cache), (value, value_cache)):
        cache.view(num_blocks * block_size, kv_heads * head_dim).index_copy_(
            0, slots, src.reshape(-1, kv_heads * head_dim).to(cache.dtype))


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, *, plan: AttentionPlan | None = None) -> None:
    """:func:`workbench.kernels.reference.rotary_embedding` (in place, bit for bit): one numba
    call (:mod:`workbench.kernels.cpu_rope_kv`), or where numba is missing four ops per
    tensor, ``t * [cos, cos] + [x2, x1] * [-sin, sin]``, with the tables for ``positions``
    gathered once per plan (one forward). fp32 only; other dtypes take the reference (it
    rounds once, after fp32 math)."""
    if query.dtype != torch.float32 or key.dtype != torch.float32:
        from workbench.kernels import reference

        return reference.rotary_embedding(positions, query, key, cos_sin_cache)
    if cos_sin_cache.dtype is torch.float32 and cpu_rope_kv.available():
        return cpu_rope_kv.rotary_embedding(positions, query, key, cos_sin_cache)
    tables = plan.rotary if plan is not None else {}
    cache_key = (cos_sin_cache.data_ptr(), positions.data_ptr(), positions.shape[0])
    if cache_key not in tables:
        half = cos_sin_cache.shape[-1] // 2
        rows = cos_sin_cache[positions.long()].float()
        cos, sin = rows[:, :half], rows[:, half:]
        tables[cache_key] = (torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None])
    cos2, sin2 = tables[cache_key]
    half = query.shape[-1] // 2
    for t in (query, key):
        swapped = torch.cat((t[..., half:], t[..., :half]), -1)
        swapped.mul_(sin2)
        t.mul_(cos2).add_(swapped)
