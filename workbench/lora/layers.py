"""The LoRA projections: a model's linear layer plus the batched low-rank update of every
adapter in the batch, applied per token by adapter slot.

``LinearWithLoRA`` wraps a (possibly fused) projection -- q/k/v in one matmul, gate/up in
another -- and keeps, for each of its shards (``q_proj``, ``k_proj``, ...), fixed slot
tensors ``lora_a[slot]`` [max_rank, in] and ``lora_b[slot]`` [rows, max_rank]: slot 0 is "no
adapter" and stays zero; an adapter of rank r < max_rank is zero-padded (the padding adds
exact zeros). ``forward(x) = base(x)``, then each shard's output columns get
``ops.add_lora`` with the step's :class:`LoRAMapping`.

The slot tensors are the engine's own state (written whenever an adapter is activated), not
weights: plain tensor attributes, never parameters or buffers, so the model's parameters and
buffers are exactly its read-only base weights (what an engine's forks share; see
:mod:`workbench.engine.fork`).
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.kernels import ops


class LoRAMapping:
    """The current forward's adapter slot per token, shared by every LoRA layer of a model.

    ``token_lora_indices`` int64 [num_tokens] on the model's device (0: no adapter);
    ``slots`` the distinct non-zero slots in it; ``plan`` the backend's grouping
    (:func:`workbench.kernels.ops.plan_lora`). Empty (no slot): the layers add nothing.
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.token_lora_indices: torch.Tensor | None = None
        self.slots: frozenset[int] = frozenset()
        self.plan = None

    def set(self, token_lora_indices: torch.Tensor) -> None:
        self.slots = frozenset(s for s in token_lora_indices.unique().tolist() if s > 0)
        self.token_lora_indices = token_lora_indices
        self.plan = ops.plan_lora(token_lora_indices, backend=self.backend) if self.slots else None

    def clear(self) -> None:
        self.token_lora_indices, self.slots, self.plan = None, frozenset(), None


class LinearWithLoRA(nn.Module):
    """A projection with per-slot LoRA weights for each of its shards (see module docstring).

    ``shard_names[i]`` is the Hugging Face module name of the base layer's i-th shard
    (``{"q": "q_proj", ...}`` order); it exposes the base's ``weight``, ``bias`` and ``shards``.
    """

    def __init__(self, base: nn.Module, shard_names: list[str], mapping: LoRAMapping,
                 num_slots: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.mapping = mapping
        out_features, in_features = base.weight.shape
        self.in_features = in_features
        dt, dev = base.weight.dtype, base.weight.device
        self.shard_names = list(shard_names)
        self.columns: dict[str, slice] = {}
        start = 0
        for name, rows in zip(self.shard_names, base.shards.values()):
            self.columns[name] = slice(start, start + rows)
            start += rows
        self.lora_a: dict[str, torch.Tensor] = {
            n: torch.zeros(num_slots, max_rank, in_features, dtype=dt, device=dev) for n in self.shard_names}
        self.lora_b: dict[str, torch.Tensor] = {
            n: torch.zeros(num_slots, c.stop - c.start, max_rank, dtype=dt, device=dev)
            for n, c in self.columns.items()}
        #: Slots holding non-zero weights, per shard (a shard no adapter in the batch targets
        #: is skipped).
        self.filled: dict[str, set[int]] = {n: set() for n in self.shard_names}

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    @property
    def shards(self) -> dict[str, int]:
        return self.base.shards

    def set_slot(self, slot: int, shard: str, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """Write one adapter's shard weights (``lora_b`` already scaled) into ``slot``."""
        rank = lora_a.shape[0]
        self.lora_a[shard][slot].zero_()
        self.lora_b[shard][slot].zero_()
        self.lora_a[shard][slot, :rank].copy_(lora_a)
        self.lora_b[shard][slot, :, :rank].copy_(lora_b)
        self.filled[shard].add(slot)

    def clear_slot(self, slot: int) -> None:
        for shard in self.shard_names:
            if slot in self.filled[shard]:
                self.lora_a[shard][slot].zero_()
                self.lora_b[shard][slot].zero_()
                self.filled[shard].discard(slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        m = self.mapping
        if not m.slots:
            return y
        for shard in self.shard_names:
            if self.filled[shard] & m.slots:
                ops.add_lora(y[:, self.columns[shard]], x, self.lora_a[shard], self.lora_b[shard],
                             m.token_lora_indices, backend=m.backend, plan=m.plan)
        return y

    def extra_repr(self) -> str:
        slots, rank = self.lora_a[self.shard_names[0]].shape[:2]
        return f"shards={self.shard_names}, slots={slots}, max_rank={rank}"
