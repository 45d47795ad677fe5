"""WorkerLoRAManager: the model runner's side of multi-LoRA (vLLM's name).

It wraps the model's projections in :class:`~workbench.lora.layers.LinearWithLoRA` (q/k/v
and gate/up stay fused: each Hugging Face module is a shard of a fused layer), loads
adapters from disk into the :class:`~workbench.lora.models.LoRAModelManager`, and before each
forward maps every scheduled token to its adapter's device slot. An adapter evicted from
host memory is read from its path again when a batch needs it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from workbench.lora.layers import LinearWithLoRA, LoRAMapping
from workbench.lora.models import LoRAModel, LoRAModelManager
from workbench.lora.request import LoRARequest

#: Per decoder layer: (attribute path of the projection, its shards' Hugging Face names).
_PROJECTIONS = (
    ("self_attn.qkv_proj", "self_attn", ("q_proj", "k_proj", "v_proj")),
    ("self_attn.o_proj", "self_attn", ("o_proj",)),
    ("mlp.gate_up_proj", "mlp", ("gate_proj", "up_proj")),
    ("mlp.down_proj", "mlp", ("down_proj",)),
)


class WorkerLoRAManager:
    """Multi-LoRA for one model (a Llama-family ``model.layers``): slots, loading, mapping."""

    def __init__(self, model: nn.Module, *, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, backend: str) -> None:
        self.max_lora_rank = max_lora_rank
        self.mapping = LoRAMapping(backend)
        self.dtype = next(model.parameters()).dtype
        #: Hugging Face module name -> (LoRA layer, shard), and -> (in_features, out_features).
        self.modules: dict[str, tuple[LinearWithLoRA, str]] = {}
        self.expected_modules: dict[str, tuple[int, int]] = {}
        for i, layer in enumerate(model.layers):
            for path, prefix, names in _PROJECTIONS:
                parent_name, attr = path.split(".")
                parent = getattr(layer, parent_name)
                wrapped = LinearWithLoRA(getattr(parent, attr), list(names), self.mapping,
                                         max_loras + 1, max_lora_rank)
                setattr(parent, attr, wrapped)
                for name in names:
                    hf = f"model.layers.{i}.{prefix}.{name}"
                    cols = wrapped.columns[name]
                    self.modules[hf] = (wrapped, name)
                    self.expected_modules[hf] = (wrapped.in_features, cols.stop - cols.start)
        self.layers = list(dict.fromkeys(w for w, _ in self.modules.values()))
        self.manager = LoRAModelManager(max_loras, max_cpu_loras, self._write_slot, self._clear_slot)
        self._requests: dict[int, LoRARequest] = {}  # every adapter added: reload after eviction

    # ------------------------------------------------------------------ adapters
    def load_adapter(self, lora_request: LoRARequest) -> LoRAModel:
        return LoRAModel.from_local_checkpoint(
            lora_request.lora_path, lora_request.lora_int_id, lora_request.lora_name,
            expected_modules=self.expected_modules, max_lora_rank=self.max_lora_rank, dtype=self.dtype)

    def add_adapter(self, lora_request: LoRARequest) -> bool:
        """Load and register (ValueError naming the file on a bad adapter; nothing changed);
        False when that id is registered already."""
        if lora_request.lora_int_id in self.manager.registered:
            self.manager.registered.move_to_end(lora_request.lora_int_id)
            return False
        model = self.load_adapter(lora_request)
        self._requests[lora_request.lora_int_id] = lora_request
        return self.manager.add_adapter(model)

    def remove_adapter(self, lora_id: int) -> bool:
        self._requests.pop(lora_id, None)
        return self.manager.remove_adapter(lora_id)

    def pin_adapter(self, lora_id: int) -> bool:
        return self.manager.pin_adapter(lora_id)

    def list_adapters(self) -> set[int]:
        return self.manager.list_adapters()

    def fork_shared(self) -> list[LoRAModel]:
        """What an engine's fork shares: the adapters in host memory (immutable once read).
        The slots, their LRU order and the mapping are each engine's own."""
        return list(self.manager.registered.values())

    # ------------------------------------------------------------------ per forward
    def set_active_adapters(self, lora_requests: Sequence[LoRARequest | None],
                            num_tokens: Sequence[int], device: torch.device) -> torch.Tensor | None:
        """Map the batch: request ``i`` (adapter ``lora_requests[i]``, None for the base model)
        contributes ``num_tokens[i]`` tokens. Loads adapters not in host memory, activates
        them, and returns (and shares with the layers) the per-token slot tensor; None, and
        an empty mapping, when no request has an adapter."""
        ids = [r.lora_int_id for r in lora_requests if r is not None]
        if not ids:
            self.mapping.clear()
            return None
        for r in lora_requests:
            if r is not None and r.lora_int_id not in self.manager.registered:
                self.add_adapter(self._requests.get(r.lora_int_id, r))
        slot_of = self.manager.activate(ids)
        slots = [0 if r is None else slot_of[r.lora_int_id] for r in lora_requests]
        index = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64),
                                        torch.tensor(list(num_tokens), dtype=torch.int64))
        index = index.to(device)
        self.mapping.set(index)
        return index

    def clear_mapping(self) -> None:
        self.mapping.clear()

    def _write_slot(self, slot: int, model: LoRAModel) -> None:
        self._clear_slot(slot)
        for name, weights in model.loras.items():
            layer, shard = self.modules[name]
            device = layer.lora_a[shard].device
            layer.set_slot(slot, shard, weights.lora_a.to(device), weights.lora_b.to(device))

    def _clear_slot(self, slot: int) -> None:
        for layer in self.layers:
            layer.clear_slot(slot)

    def active_adapters(self) -> dict[int, int]:
        """Adapter id -> device slot, least recently used first."""
        return dict(self.manager.slot_of)

