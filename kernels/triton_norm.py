"""Triton RMSNorm, optionally fused with the residual add (vLLM's ``fused_add_rms_norm``).

Contract: :func:`workbench.kernels.reference.rms_norm`. One program per row holds the whole
row (``BLOCK = next_power_of_2(hidden)``) in registers: read x (and residual), write the new
residual stream ``h = x + residual`` rounded to x's dtype (exactly what the reference keeps),
then ``h * rsqrt(mean(h^2) + eps) * weight`` computed in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm"]

#: Largest hidden size one program holds in registers.
MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    eps, stride_x, stride_r, stride_o, stride_ro,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, 0) / HIDDEN + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (h * inv_rms * w).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm over the last dimension; see :func:`workbench.kernels.reference.rms_norm`.

    Returns ``out`` or, with ``residual``, ``(out, x + residual)``; new tensors, inputs untouched.
    """
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [hidden={hidden}], got {tuple(weight.shape)}.")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size must be at most {MAX_HIDDEN}, got {hidden}.")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}.")
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ro2 = res_out.view(-1, hidden)
    else:
        r2 = ro2 = x2  # unused when HAS_RESIDUAL is False
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out2, ro2, float(eps),
            x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0),
            HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 256)),
        )
    return out if residual is None else (out, res_out)
