"""Products of a few activation rows with an fp32 CPU weight, reading the weight once.

Contract: ``F.linear(x, weight, bias)`` up to floating-point rounding, for a 2-D fp32 ``x`` of
1 to :data:`MAX_ROWS` rows and an fp32 ``weight`` ``[out, in]`` stored output-major
(contiguous: each output's weights in one run, the checkpoint's layout); see :func:`eligible`.

Why: a decode step and a speculative verify chunk (k + 1 rows) multiply a few rows by every
weight of the model. Such a product is bound by reading the weight, but the GEMMs torch calls
are built for many rows: on the AMD EPYC this VM sometimes is, MKL's SGEMM costs 2-4x its
1-row product from 3 rows on, and oneDNN adds a fixed ~12-25 us a call. This kernel reads
the weight once, as two sequential streams (the first and the second half of the outputs,
one row of each at a time: the hardware prefetcher follows two long streams, where pairs of
adjacent rows left it behind, 2x slower cold), and takes each weight row's dot product with
the activation rows, four at a time, while those stay in the core's L1 cache. There 5 rows
cost 1.3-1.4x one row, and one row 0.6-0.8x of MKL's (cold, as in a forward: ``python -m
workbench.kernels.cpu_linear`` prints both); one stream at a time cost 1.5-1.8x and 0.7-1.0x.

Numba compiles it once per machine (``cache=True``; nopython, ``fastmath`` so that each dot
product becomes a vectorised reduction), single-threaded, without the GIL. Where numba cannot
be imported, :func:`available` is False and products take torch's path.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from workbench.kernels import cpu_numba

#: Most rows the kernel takes: past 8 its cost grows with the rows (it does the arithmetic of
#: every row without a GEMM's register blocking) and oneDNN's or MKL's GEMM wins (measured on
#: the embedded model's shapes at 1 and 2 threads: even at 8 rows, ahead at 12-16).
MAX_ROWS = 8


def _dot_rows(x, weight, out):
    """out[m, n] = dot(x[m], weight[n]). Outputs n and n + half are taken side by side (two
    long sequential streams through the weight, which the prefetcher follows; two adjacent
    rows at a time it does not), and rows in groups of four share both weight rows' loads."""
    rows, inner = x.shape
    total = weight.shape[0]
    half = total // 2
    grouped = rows - rows % 4
    for n in range(half):
        a, b = weight[n], weight[n + half]
        for m in range(0, grouped, 4):
            x0, x1, x2, x3 = x[m], x[m + 1], x[m + 2], x[m + 3]
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
            for k in range(inner):
                va, vb = a[k], b[k]
                a0 += x0[k] * va
                a1 += x1[k] * va
                a2 += x2[k] * va
                a3 += x3[k] * va
                b0 += x0[k] * vb
                b1 += x1[k] * vb
                b2 += x2[k] * vb
                b3 += x3[k] * vb
            out[m, n], out[m + 1, n], out[m + 2, n], out[m + 3, n] = a0, a1, a2, a3
            out[m, n + half], out[m + 1, n + half], out[m + 2, n + half], out[m + 3, n + half] = b0, b1, b2, b3
        for m in range(grouped, rows):
            xm = x[m]
            sa = sb = np.float32(0.0)
            for k in range(inner):
                sa += xm[k] * a[k]
                sb += xm[k] * b[k]
            out[m, n], out[m, n + half] = sa, sb
    if total % 2:  # the last output of an odd count
        w = weight[total - 1]
        for m in range(rows):
            xm = x[m]
            s = np.float32(0.0)
            for k in range(inner):
                s += xm[k] * w[k]
            out[m, total - 1] = s


@functools.cache
def _compiled():
    """The numba-compiled :func:`_dot_rows` (compiled here, once, or read from numba's cache),
    or None where numba cannot be imported."""
    return cpu_numba.njit(_dot_rows, "void(float32[:, ::1], float32[:, ::1], float32[:, ::1])")


def available() -> bool:
    """Whether the kernel can run here (numba imports); compiles it on the first call."""
    return _compiled() is not None


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear(x, weight)`` is the kernel's: 1..MAX_ROWS fp32 CPU rows, an fp32 CPU
    output-major weight, no autograd (cheapest tests first: every product of a step asks)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype is torch.float32
            and weight.dtype is torch.float32 and x.is_cpu and weight.is_cpu
            and weight.is_contiguous() and not (x.requires_grad or weight.requires_grad))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the kernel; the caller checked :func:`eligible` and
    :func:`available`."""
    out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
    _compiled()(x.contiguous().numpy(), weight.numpy(), out)
    y = torch.from_numpy(out)
    return y if bias is None else y.add_(bias)
