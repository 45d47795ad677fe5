"""The batched LoRA update on CPU, grouped by adapter (SGMV's idea): one pair of matmuls per
adapter in the batch instead of a gathered matrix per token.

Contract: :func:`workbench.kernels.reference.add_lora`. :func:`plan_lora` groups the tokens
once per forward (every layer's projections share it).
"""

from __future__ import annotations

import torch

__all__ = ["plan_lora", "add_lora"]


def plan_lora(token_lora_indices: torch.Tensor) -> list[tuple[int, torch.Tensor | slice]]:
    """``(slot, rows)`` for each adapter slot > 0 present in the batch, in slot order; rows is
    a slice when that slot's tokens are contiguous, else an index tensor."""
    idx = token_lora_indices.long().cpu()
    plan: list[tuple[int, torch.Tensor | slice]] = []
    for slot in torch.unique(idx).tolist():
        if slot <= 0:
            continue
        rows = (idx == slot).nonzero().squeeze(1)
        first, last = int(rows[0]), int(rows[-1])
        plan.append((slot, slice(first, last + 1) if last - first + 1 == rows.numel() else rows))
    return plan


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             token_lora_indices: torch.Tensor, *, plan=None) -> None:
    """``y[rows] += (x[rows] @ lora_a[s].T) @ lora_b[s].T`` for each ``(s, rows)`` of the plan."""
    for slot, rows in (plan if plan is not None else plan_lora(token_lora_indices)):
        delta = (x[rows] @ lora_a[slot].t()) @ lora_b[slot].t()
        if isinstance(rows, slice):
            y[rows] += delta
        else:
            y.index_add_(0, rows, delta)
