"""Triton LoRA kernels in the style of Punica's BGMV: a token-by-token gathered matrix-vector
product, shrink (x @ A[i].T -> h, rank-wide) then expand (y += h @ B[i].T).

Contract: :func:`workbench.kernels.reference.add_lora`. One program per token (shrink) or
per (token, block of output columns) (expand) reads that token's slot ``i`` and returns at
once when ``i == 0`` (no adapter): mixed batches cost only their adapted tokens. The
products are broadcast-multiply-and-sum in fp32 (no ``tl.dot``: the rank is small, and the
interpreter computes it exactly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["add_lora"]


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr, a_ptr, idx_ptr, h_ptr,
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ht,
    K, R, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(idx_ptr + token).to(tl.int64)
    if slot <= 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + token * stride_xt + offs_k * stride_xk, mask=offs_k < K, other=0.0)
        a = tl.load(a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :] * stride_ak,
                    mask=(offs_r[:, None] < R) & (offs_k[None, :] < K), other=0.0)
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(h_ptr + token * stride_ht + offs_r, acc, mask=offs_r < R)


@triton.jit
def _bgmv_expand_kernel(
    h_ptr, b_ptr, idx_ptr, y_ptr,
    stride_ht, stride_bs, stride_bn, stride_br, stride_yt, stride_yn,
    N, R, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(idx_ptr + token).to(tl.int64)
    if slot <= 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    h = tl.load(h_ptr + token * stride_ht + offs_r, mask=offs_r < R, other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                mask=(offs_n[:, None] < N) & (offs_r[None, :] < R), other=0.0)
    delta = tl.sum(b.to(tl.float32) * h[None, :], axis=1)
    y_ptrs = y_ptr + token * stride_yt + offs_n * stride_yn
    y = tl.load(y_ptrs, mask=offs_n < N, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=offs_n < N)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             token_lora_indices: torch.Tensor) -> None:
    """Triton shrink + expand; see :func:`workbench.kernels.reference.add_lora`."""
    num_tokens, k = x.shape
    num_slots, rank, k_a = lora_a.shape
    n = y.shape[1]
    if k_a != k or lora_b.shape != (num_slots, n, rank) or y.shape[0] != num_tokens \
            or token_lora_indices.shape != (num_tokens,):
        raise ValueError(
            f"add_lora: shapes do not match: y {tuple(y.shape)}, x {tuple(x.shape)}, lora_a "
            f"{tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}, indices {tuple(token_lora_indices.shape)}")
    if num_tokens == 0:
        return
    h = torch.zeros((num_tokens, rank), dtype=torch.float32, device=x.device)
    block_r = triton.next_power_of_2(rank)
    _bgmv_shrink_kernel[(num_tokens,)](
        x, lora_a, token_lora_indices, h,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), h.stride(0),
        k, rank, BLOCK_R=block_r, BLOCK_K=min(128, triton.next_power_of_2(k)),
    )
    block_n = min(128, triton.next_power_of_2(n))
    _bgmv_expand_kernel[(num_tokens, triton.cdiv(n, block_n))](
        h, lora_b, token_lora_indices, y,
        h.stride(0), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), y.stride(0), y.stride(1),
        n, rank, BLOCK_R=block_r, BLOCK_N=block_n,
    )
