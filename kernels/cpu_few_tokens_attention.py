"""Paged attention for a step of few query tokens (decodes, speculative verify chunks), in
one numba call that reads K and V straight from the paged cache.

Contract: :func:`workbench.kernels.reference.paged_attention` up to floating-point rounding
(fp32 math; scores ``q . k * scale``, a max-subtracted softmax), for fp32 queries and caches,
with or without a sliding window; see :func:`eligible`.

Why: for a few query tokens the work is tiny (a decode over 200 positions of the embedded
model is ~80 K multiply-adds a layer), but the batched path of
:mod:`workbench.kernels.cpu_attention` pays for its layout: a plan of ~15 torch operations
per forward (~150 us for one decode), then per layer two gathers, a scaled-dot-product call
and its copies (~75 us). This kernel walks each query token's visible positions through the
block tables in place, per sequence and KV head (each cached row read once for all the query
tokens and heads that see it): the scores and their maxima, then the exponentials and their
sums (a vectorised exp), then the weighted values; single-threaded, without the GIL.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from workbench.kernels import cpu_numba

#: Most query tokens a step may have for this kernel: a batch of up to eight decodes or a few
#: verify chunks. Larger steps keep the batched path, whose SDPA calls use every torch thread
#: (measured against it up to 8 decodes only: 147 against 221 us a layer at one thread).
MAX_TOKENS = 16


def _attend(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
            window, out):
    """out[t, h] = softmax(q . k * scale over t's visible positions) . v for every query token
    t and query head h. Per sequence and KV head, each cached row is read once for all the
    sequence's query tokens that see it and all the query heads sharing that KV head."""
    block_size, kv_heads, size = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    group = query.shape[1] // kv_heads
    longest, most = 0, 0
    for s in range(seq_lens.shape[0]):
        longest = max(longest, seq_lens[s])
        most = max(most, query_start_loc[s + 1] - query_start_loc[s])
    scores = np.empty((most, group, longest), dtype=np.float32)
    acc = np.empty((most, group, size), dtype=np.float32)
    top = np.empty((most, group), dtype=np.float32)
    total = np.empty((most, group), dtype=np.float32)
    bits = np.empty(longest, dtype=np.int32)
    powers = bits.view(np.float32)  # 2**k, written as its bits
    for s in range(seq_lens.shape[0]):
        first, length = query_start_loc[s], seq_lens[s]
        n = query_start_loc[s + 1] - first
        start = length - n  # the position of the sequence's first query token
        low = max(0, start - window + 1) if window > 0 else 0  # the first position any sees
        table = block_tables[s]
        for kv in range(kv_heads):
            top[:n] = -np.inf
            for p in range(low, length):
                k = key_cache[table[p // block_size], p % block_size, kv]
                for j in range(max(0, p - start), n):  # the tokens at or after p
                    if window > 0 and p <= start + j - window:
                        continue
                    for g in range(group):
                        q = query[first + j, kv * group + g]
                        dot = np.float32(0.0)
                        for d in range(size):
                            dot += q[d] * k[d]
                        dot *= scale
                        scores[j, g, p - low] = dot
                        top[j, g] = max(top[j, g], dot)
            for j in range(n):
                seen_from = max(low, start + j - window + 1) if window > 0 else low
                for g in range(group):
                    # exp(score - max) in two loops LLVM vectorises (libm's expf is a call per
                    # element): 2**k through the exponent bits, exp(r) for |r| <= ln 2 / 2 by a
                    # degree-6 Taylor polynomial; within 2.3e-7 relative of exp
                    row = scores[j, g, seen_from - low:start + j + 1 - low]
                    for i in range(row.shape[0]):
                        x = max(row[i] - top[j, g], np.float32(-87.0))
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
                    total[j, g] = sum_
            acc[:n] = 0.0
            for p in range(low, length):
                v = value_cache[table[p // block_size], p % block_size, kv]
                for j in range(max(0, p - start), n):
                    if window > 0 and p <= start + j - window:
                        continue
                    for g in range(group):
                        weight = scores[j, g, p - low]
                        a = acc[j, g]
                        for d in range(size):
                            a[d] += weight * v[d]
            for j in range(n):
                for g in range(group):
                    o = out[first + j, kv * group + g]
                    for d in range(size):
                        o[d] = acc[j, g, d] / total[j, g]


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


def takes_step(num_tokens: int) -> bool:
    """Whether a step of ``num_tokens`` query tokens is this kernel's (where numba imports)."""
    return 0 < num_tokens <= MAX_TOKENS and available()


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


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    step: StepLayout, scale: float, *, sliding_window: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`workbench.kernels.reference.paged_attention` by the kernel (no softcap) for the
    step laid out in ``step``; the caller checked :func:`eligible` and :func:`takes_step`."""
    result = out if out is not None and out.is_contiguous() else torch.empty(query.shape, dtype=torch.float32)
    _compiled()(query.detach().contiguous().numpy(), key_cache.numpy(), value_cache.numpy(),
                *step, scale, sliding_window or 0, result.numpy())
    return result if out is None or out is result else out.copy_(result)
