"""LoRASlots: the device slots of :class:`~workbench.lora.models.LoRAModelManager`, by adapter name, to count loads.

``max_loras`` slots, least recently used first out; a pinned adapter is never evicted, nor an
adapter of the batch being set up. :meth:`activate` gives every adapter of a batch a slot and
returns how many were not in one (each is a load: its weights copied into the slot), as the
manager's ``activate`` does. A batch of base-model requests only touches nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class LoRASlots:
    """Which adapters sit in the ``max_loras`` device slots (LRU order, pinned ones kept)."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}.")
        self.max_loras = max_loras
        self.resident: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.pinned: set[str] = set()

    def activate(self, names: Iterable[str]) -> int:
        """Put the batch's adapters in slots; the number loaded (not resident before)."""
        batch = list(dict.fromkeys(names))
        if len(batch) > self.max_loras:
            raise ValueError(f"a batch uses {len(batch)} adapters > max_loras={self.max_loras}.")
        loads = 0
        for name in batch:
            if name in self.resident:
                self.resident.move_to_end(name)
                continue
            if len(self.resident) == self.max_loras:
                victim = next((n for n in self.resident if n not in self.pinned and n not in batch), None)
                if victim is None:
                    raise ValueError(f"no free LoRA slot for {name!r}: all max_loras={self.max_loras} "
                                     "slots are pinned or in this batch.")
                del self.resident[victim]
            self.resident[name] = None
            loads += 1
        return loads

    def pin(self, name: str) -> int:
        """Load ``name`` into a slot (if it is not in one) and never evict it; loads made."""
        loads = self.activate([name])
        self.pinned.add(name)
        return loads

    def discard(self, name: str) -> None:
        """The adapter was removed: its slot is free."""
        self.resident.pop(name, None)
        self.pinned.discard(name)

    def __repr__(self) -> str:
        return f"LoRASlots(max_loras={self.max_loras}, resident={list(self.resident)}, pinned={sorted(self.pinned)})"
