"""Attention and layer kernels (installed as ``workbench.kernels``).

Each public function dispatches to the Triton implementation or to the plain-torch reference
in :mod:`workbench.kernels.reference` (same signature). ``backend=None`` picks Triton for CUDA
tensors and the reference otherwise; ``backend="triton"`` on CPU needs ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from workbench.kernels import reference

__all__ = ["paged_attention", "write_kv_cache", "rms_norm", "rotary_embedding", "reference"]

BACKENDS = ("torch", "triton")


def _use_triton(backend: str | None, tensor: torch.Tensor) -> bool:
    if backend is None:
        return tensor.is_cuda
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}.")
    return backend == "triton"


def paged_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                    scale, *, sliding_window=None, softcap=None, out=None, backend=None):
    """See :func:`workbench.kernels.reference.paged_attention` for the contract."""
    if _use_triton(backend, query):
        from workbench.kernels import triton_attention

        return triton_attention.paged_attention(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
            sliding_window=sliding_window, softcap=softcap, out=out)
    return reference.paged_attention(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
        sliding_window=sliding_window, softcap=softcap, out=out)


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, backend=None):
    """See :func:`workbench.kernels.reference.write_kv_cache`."""
    if _use_triton(backend, key):
        from workbench.kernels import triton_cache

        return triton_cache.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    return reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def rms_norm(x, weight, eps, residual=None, *, backend=None):
    """See :func:`workbench.kernels.reference.rms_norm`."""
    if _use_triton(backend, x):
        from workbench.kernels import triton_norm

        return triton_norm.rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def rotary_embedding(positions, query, key, cos_sin_cache, *, backend=None):
    """See :func:`workbench.kernels.reference.rotary_embedding`."""
    if _use_triton(backend, query):
        from workbench.kernels import triton_rope

        return triton_rope.rotary_embedding(positions, query, key, cos_sin_cache)
    return reference.rotary_embedding(positions, query, key, cos_sin_cache)
