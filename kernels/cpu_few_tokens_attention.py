"""Paged attention for a step of few query tokens a sequence (decodes, speculative verify
chunks), in one numba call that reads K and V straight from the paged cache.

Contract: :func:`workbench.kernels.reference.paged_attention` up to floating-point rounding
(fp32 math; scores ``(q * scale) . k``, a max-subtracted softmax), for fp32 queries and caches,
with or without a sliding window; see :func:`eligible` and :func:`takes_step`.

Why: for a few query tokens the work is tiny (a decode over 200 positions of the embedded
model is ~80 K multiply-adds a layer), but the batched path of
:mod:`workbench.kernels.cpu_attention` pays for its layout: a plan of ~15 torch operations
per forward (~150 us for one decode), then per layer two gathers, a scaled-dot-product call
and its copies (~75 us). This kernel walks each sequence's visible positions through the block
tables in place, block by block, every KV head of a position at once (each cached row read
once, for all the query tokens and heads that see it): the scores, then each row's maximum,
exponentials and their sum (a vectorised exp), then the weighted values; single-threaded,
without the GIL. One decode over 200 positions costs ~17 us a layer, a 5-token verify chunk
~45, 8 decodes ~86 (1 thread).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from workbench.kernels import cpu_numba

#: Most query tokens one sequence may have in a step this kernel takes: decodes and speculative
#: verify chunks up to k + 1 = 6. Its cost grows with tokens x positions, where the batched
#: path's products amortise their gathers over a chunk's tokens. A forward of the embedded
#: model (4 layers, plan included) took, against the batched path's: 5-token chunks 0.44-0.61x
#: over 200-300 positions and 0.99-1.08x over 1,000; a chunk of 8 over 1,000 1.35-1.50x, of 16
#: 1.90-2.23x (1 and 2 threads).
MAX_QUERY_TOKENS = 6
#: Most cached positions (summed over the step's sequences) it reads when torch runs on more
#: than one thread: it is single-threaded, and once the cache outgrows the L3 the batched
#: path's threads read it faster. At 2 threads decodes took 0.61x over 8 x 200 positions and
#: 0.65x over 256 x 100, but 1.04-1.17x over 96 x 250, 128 x 250 and 32 x 1,000: the crossover
#: moves with the sequences' lengths, so the bound keeps a margin below it. At 1 thread it took
#: 0.38-0.73x up to 256 x 250 positions, so there it is not bounded.
MAX_POSITIONS = 16_384


def _attend(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
            window, out):
    """out[t, h] = softmax((q * scale) . k over t's visible positions) . v for every query
    token t and query head h. Per sequence, its query rows are gathered KV head by KV head
    (row m = kv * n * group + j * group + g: token j, head kv * group + g), and each cached
    position is read once, block by block and all KV heads together, for the rows that see
    it: under each KV head, the contiguous rows of the tokens at or after it (and, with a
    window, before it + window)."""
    block_size, kv_heads, size = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    heads = query.shape[1]
    group = heads // kv_heads
    longest, most = 0, 0
    for s in range(seq_lens.shape[0]):
        longest = max(longest, seq_lens[s])
        most = max(most, query_start_loc[s + 1] - query_start_loc[s])
    queries = np.empty((most * heads, size), dtype=np.float32)
    scores = np.empty((most * heads, longest), dtype=np.float32)  # [row, position - low]
    acc = np.empty((most * heads, size), dtype=np.float32)
    total = np.empty(most * heads, dtype=np.float32)
    bits = np.empty(longest, dtype=np.int32)
    powers = bits.view(np.float32)  # 2**k, written as its bits
    for s in range(seq_lens.shape[0]):
        first, length = query_start_loc[s], seq_lens[s]
        n = query_start_loc[s + 1] - first
        rows, per_kv = n * heads, n * group
        start = length - n  # the position of the sequence's first query token
        low = max(0, start - window + 1) if window > 0 else 0  # the first position any sees
        table = block_tables[s]
        blocks = range(low // block_size, (length + block_size - 1) // block_size)
        for m in range(rows):
            kv, j, g = m // per_kv, m % per_kv // group, m % group
            q, row = query[first + j, kv * group + g], queries[m]
            for d in range(size):
                row[d] = q[d] * scale
        for b in blocks:  # the scores
            block = table[b]
            for o in range(max(low - b * block_size, 0), min(length - b * block_size, block_size)):
                p = b * block_size + o
                stop = min(n, p - start + window) if window > 0 else n
                for kv in range(kv_heads):
                    k = key_cache[block, o, kv]
                    for m in range(kv * per_kv + max(0, p - start) * group, kv * per_kv + stop * group):
                        q = queries[m]
                        dot = np.float32(0.0)
                        for d in range(size):
                            dot += q[d] * k[d]
                        scores[m, p - low] = dot
        for m in range(rows):  # the softmax numerators and their sums, row by row
            j = m % per_kv // group
            seen_from = max(low, start + j - window + 1) if window > 0 else low
            row = scores[m, seen_from - low:start + j + 1 - low]
            top = row[0]
            for i in range(1, row.shape[0]):
                top = max(top, row[i])
            # exp(score - max) in two loops LLVM vectorises (libm's expf is a call per
            # element): 2**k through the exponent bits, exp(r) for |r| <= ln 2 / 2 by a
            # degree-6 Taylor polynomial; within 2.3e-7 relative of exp
            for i in range(row.shape[0]):
                x = max(row[i] - top, np.float32(-87.0))
                power = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
                r = (x - power * np.float32(0.693145751953125)
                     - power * np.float32(1.428606765330187e-06))
                e = np.float32(1.0 / 720.0)
                e = e * r + np.float32(1.0 / 120.0)
                e = e * r + np.float32(1.0 / 24.0)
                e = e * r + np.float32(1.0 / 6.0)
                e = e * r + np.float32(0.5)
                e = e * r + np.float32(1.0)
                row[i] = e * r + np.float32(1.0)
                bits[i] = (np.int32(power) + np.int32(127)) << np.int32(23)
            sum_ = np.float32(0.0)
            for i in range(row.shape[0]):
                row[i] *= powers[i]
                sum_ += row[i]
            total[m] = sum_
        acc[:rows] = 0.0
        for b in blocks:  # the weighted values, over the same rows and positions
            block = table[b]
            for o in range(max(low - b * block_size, 0), min(length - b * block_size, block_size)):
                p = b * block_size + o
                stop = min(n, p - start + window) if window > 0 else n
                for kv in range(kv_heads):
                    v = value_cache[block, o, kv]
                    for m in range(kv * per_kv + max(0, p - start) * group, kv * per_kv + stop * group):
                        weight = scores[m, p - low]
                        a = acc[m]
                        for d in range(size):
                            a[d] += weight * v[d]
        for m in range(rows):
            kv, j, g = m // per_kv, m % per_kv // group, m % group
            o_row, a, t = out[first + j, kv * group + g], acc[m], total[m]
            for d in range(size):
                o_row[d] = a[d] / t


@functools.cache
def _compiled():
    """The numba-compiled :func:`_attend`, or None where numba cannot be imported. Only
    reassociation (the dot products' vector lanes) and FMA contraction are allowed."""
    return cpu_numba.njit(
        _attend, "void(float32[:, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], int32[:, ::1], "
                 "int32[::1], int32[::1], float32, int64, float32[:, :, ::1])",
        fastmath={"reassoc", "contract"})


def available() -> bool:
    """Whether the kernel can run here (numba imports); compiles it on the first call."""
    return _compiled() is not None




def eligible(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the tensors are the kernel's: fp32 on the CPU, contiguous caches, no autograd."""
    return (query.dtype is key_cache.dtype is value_cache.dtype is torch.float32
            and query.is_cpu and key_cache.is_cpu and key_cache.is_contiguous()
            and value_cache.is_contiguous() and not query.requires_grad)


class StepLayout(NamedTuple):
    """A step's block tables, query starts and sequence lengths as int32 numpy arrays:
    converted once per forward, read by every layer's call."""

    block_tables: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray


def layout(block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> StepLayout:
    """The :class:`StepLayout` of a step's attention metadata."""
    return StepLayout(*(t.to(torch.int32).contiguous().numpy()
                        for t in (block_tables, query_start_loc, seq_lens)))


def takes_step(step: StepLayout) -> bool:
    """Whether the step laid out in ``step`` is this kernel's (where numba imports): some query
    token, at most :data:`MAX_QUERY_TOKENS` a sequence, and at most :data:`MAX_POSITIONS`
    cached positions unless torch runs on one thread."""
    starts, lens = step.query_start_loc, step.seq_lens
    return (len(lens) > 0 and starts[-1] > 0 and int(np.diff(starts).max()) <= MAX_QUERY_TOKENS
            and (torch.get_num_threads() == 1 or int(lens.sum()) <= MAX_POSITIONS) and available())


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    step: StepLayout, scale: float, *, sliding_window: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`workbench.kernels.reference.paged_attention` by the kernel (no softcap) for the
    step laid out in ``step``; the caller checked :func:`eligible` and :func:`takes_step`."""
    result = out if out is not None and out.is_contiguous() else torch.empty(query.shape, dtype=torch.float32)
    _compiled()(query.detach().contiguous().numpy(), key_cache.numpy(), value_cache.numpy(),
                *step, scale, sliding_window or 0, result.numpy())
    return result if out is None or out is result else out.copy_(result)
