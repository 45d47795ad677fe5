"""Triton ``write_kv_cache``: scatter new keys/values into the paged KV cache.

Contract: :func:`workbench.kernels.reference.write_kv_cache`. One program per token copies all
of that token's KV heads (a ``[HEADS_PAD, HEAD_PAD]`` tile) for both caches; a slot of -1
(padding, or a token whose KV is not stored) writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["write_kv_cache"]


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (offs_h < NUM_HEADS) & (offs_d < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + offs_h * stride_kh + offs_d * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h * stride_vh + offs_d * stride_vd, mask=mask)
    kc = key_cache_ptr + block * stride_kcb + offset * stride_kcs
    vc = value_cache_ptr + block * stride_vcb + offset * stride_vcs
    tl.store(kc + offs_h * stride_kch + offs_d * stride_kcd,
             k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + offs_h * stride_vch + offs_d * stride_vcd,
             v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton scatter; see :func:`workbench.kernels.reference.write_kv_cache`.

    ``key``/``value`` [num_tokens, num_kv_heads, head_dim] (any strides, e.g. views of a fused
    QKV projection); caches [num_blocks, block_size, num_kv_heads, head_dim]; ``slot_mapping``
    int32 or int64 [num_tokens]. Values are cast to the cache dtype.
    """
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            "key and value must both be [num_tokens, num_kv_heads, head_dim], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}.")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}.")
    if key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"key [.., num_kv_heads, head_dim] = {tuple(key.shape[1:])} does not match "
                         f"the cache's {tuple(key_cache.shape[2:])}.")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [num_tokens={key.shape[0]}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}.")
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    heads_pad = triton.next_power_of_2(num_heads)
    head_pad = triton.next_power_of_2(head_dim)
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        NUM_HEADS=num_heads, HEADS_PAD=heads_pad, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_SIZE=key_cache.shape[1], num_warps=4 if heads_pad * head_pad >= 1024 else 1,
    )
