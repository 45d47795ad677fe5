"""Compiling the CPU kernels with numba: once per machine where numba can keep its on-disk
cache, in memory where it cannot, not at all where numba is missing (the caller then keeps
torch's path)."""

from __future__ import annotations


def njit(fn, signature: str, fastmath: bool | set[str] = True):
    """``fn`` compiled for ``signature`` in nopython mode, without the GIL or bounds checks,
    with ``fastmath`` (True, or a set of LLVM flags); None where numba cannot be imported."""
    try:
        import numba
    except ImportError:
        return None
    options = dict(fastmath=fastmath, nogil=True, boundscheck=False)
    try:
        return numba.njit(signature, cache=True, **options)(fn)
    except RuntimeError:  # no writable cache directory (numba's "no locator available"): compile here
        return numba.njit(signature, **options)(fn)
