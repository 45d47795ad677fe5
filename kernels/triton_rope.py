"""Triton rotary embedding (neox style), in place on query and key.

Contract: :func:`workbench.kernels.reference.rotary_embedding`. One program per token reads the
token's ``cos``/``sin`` row once and rotates every query head and then every key head as
``[HEADS_PAD, HALF_PAD]`` tiles: ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)`` in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rotary_embedding"]


@triton.jit
def _rotate_heads(ptr, token, stride_t, stride_h, stride_d, cos, sin,
                  NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, HALF_PAD)[None, :]
    mask = (offs_h < NUM_HEADS) & (offs_d < HALF)
    p1 = ptr + token * stride_t + offs_h * stride_h + offs_d * stride_d
    p2 = p1 + HALF * stride_d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_cs,
    NUM_Q_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
    NUM_K_HEADS: tl.constexpr, K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, HALF_PAD)
    cmask = offs < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs, mask=cmask, other=0.0).to(tl.float32)
    cos = cos[None, :]
    sin = sin[None, :]
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, stride_qd, cos, sin,
                  NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr, token, stride_kt, stride_kh, stride_kd, cos, sin,
                  NUM_K_HEADS, K_HEADS_PAD, HALF, HALF_PAD)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Triton neox rotary embedding, in place; see
    :func:`workbench.kernels.reference.rotary_embedding`.

    ``query`` [num_tokens, num_q_heads, head_dim] and ``key`` [num_tokens, num_kv_heads,
    head_dim] may be strided views (e.g. of a fused QKV output); ``cos_sin_cache``
    [max_position, head_dim] with its last dimension contiguous.
    """
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError(f"query and key must be 3-D [num_tokens, heads, head_dim], got "
                         f"{tuple(query.shape)} and {tuple(key.shape)}.")
    num_tokens, num_q_heads, head_dim = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(f"key {tuple(key.shape)} must match query {tuple(query.shape)} in "
                         "num_tokens and head_dim.")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}.")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache must be [max_position, head_dim={head_dim}], got "
                         f"{tuple(cos_sin_cache.shape)}.")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [num_tokens={num_tokens}], got {tuple(positions.shape)}.")
    if cos_sin_cache.stride(1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    if num_tokens == 0:
        return
    half = head_dim // 2
    num_k_heads = key.shape[1]
    _rope_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache,
        *query.stride(), *key.stride(), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        NUM_K_HEADS=num_k_heads, K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), num_warps=4,
    )
