"""LoRA adapters: one adapter's weights read from PEFT's format (``LoRAModel``), and the
fixed slots they run from (``LoRAModelManager``: ``max_cpu_loras`` in host memory,
``max_loras`` on the device, both LRU, pinned adapters never evicted).

PEFT's format: ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ...) and ``adapter_model.safetensors`` holding
``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r] per
targeted module. The update is ``scaling * B @ A`` with ``scaling = lora_alpha / r`` (or
``lora_alpha / sqrt(r)`` with ``use_rslora``), exactly as PEFT computes it; it is folded into
B once, at load time.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

#: The modules an adapter may target (the Llama family's projections).
SUPPORTED_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")
#: PEFT options whose non-default value this engine cannot serve, with that default.
_UNSUPPORTED = {"use_dora": False, "bias": "none", "modules_to_save": None, "fan_in_fan_out": False,
                "lora_bias": False, "rank_pattern": {}, "alpha_pattern": {}}


def peft_scaling(lora_alpha: float, r: int, use_rslora: bool) -> float:
    """PEFT's ``LoraLayer.update_layer`` scaling."""
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r


@dataclass(frozen=True)
class LoRALayerWeights:
    """One targeted module's update: ``lora_a`` [rank, in], ``lora_b`` [out, rank] scaled."""

    module_name: str
    lora_a: torch.Tensor
    lora_b: torch.Tensor


class LoRAModel:
    """One adapter's weights in host memory, by Hugging Face module name
    (``model.layers.0.self_attn.q_proj``)."""

    def __init__(self, lora_int_id: int, name: str, rank: int, scaling: float,
                 loras: dict[str, LoRALayerWeights]) -> None:
        self.id, self.name, self.rank, self.scaling, self.loras = lora_int_id, name, rank, scaling, loras

    @property
    def num_bytes(self) -> int:
        return sum(w.lora_a.nbytes + w.lora_b.nbytes for w in self.loras.values())

    @classmethod
    def from_local_checkpoint(cls, lora_dir: str | Path, lora_int_id: int, name: str, *,
                              expected_modules: Mapping[str, tuple[int, int]], max_lora_rank: int,
                              dtype: torch.dtype = torch.float32) -> LoRAModel:
        """Read and check a PEFT adapter directory. ``expected_modules``: the model's
        LoRA-able modules, name -> (in_features, out_features). Raises ValueError naming the
        file and the rule broken (a missing file, an unsupported option, a rank above
        ``max_lora_rank``, a module the model lacks, a tensor of the wrong shape)."""
        from safetensors.torch import load_file

        lora_dir = Path(lora_dir)
        config_path, weights_path = lora_dir / CONFIG_FILE, lora_dir / WEIGHTS_FILE
        for path in (config_path, weights_path):
            if not path.is_file():
                raise ValueError(f"{path}: no such file; a LoRA adapter directory (PEFT format) "
                                 f"holds {CONFIG_FILE} and {WEIGHTS_FILE}.")
        try:
            config = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{config_path}: not a JSON file ({exc}).") from None
        if config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{config_path}: peft_type must be 'LORA', got {config.get('peft_type')!r}.")
        for key, default in _UNSUPPORTED.items():
            value = config.get(key)
            if value is not None and value != default and value not in ({}, []):
                raise ValueError(f"{config_path}: {key}={config[key]!r} is not supported "
                                 f"(only {default!r}).")
        r, alpha = config.get("r"), config.get("lora_alpha")
        if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
            raise ValueError(f"{config_path}: r must be an integer >= 1 and lora_alpha a number, "
                             f"got r={r!r}, lora_alpha={alpha!r}.")
        if r > max_lora_rank:
            raise ValueError(f"{config_path}: LoRA rank {r} is greater than max_lora_rank "
                             f"{max_lora_rank}.")
        targets = config.get("target_modules") or []
        if isinstance(targets, list):
            bad = sorted(set(targets) - set(SUPPORTED_LORA_MODULES))
            if bad:
                raise ValueError(f"{config_path}: target modules {bad} are not LoRA-able modules of "
                                 f"the model; supported: {list(SUPPORTED_LORA_MODULES)}.")
        scaling = peft_scaling(alpha, r, bool(config.get("use_rslora", False)))
        try:
            tensors = load_file(str(weights_path))
        except Exception as exc:  # noqa: BLE001 - a corrupt file, in safetensors' words
            raise ValueError(f"{weights_path}: not a safetensors file ({exc}).") from None
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            match = _TENSOR.match(key)
            if match is None:
                raise ValueError(f"{weights_path}: tensor {key!r} is not a LoRA A/B weight "
                                 "(base_model.model.<module>.lora_A|lora_B.weight).")
            module, half = match.groups()
            if module not in expected_modules:
                raise ValueError(f"{weights_path}: tensor {key!r} targets module {module!r}, which "
                                 f"the model lacks (LoRA-able: {list(SUPPORTED_LORA_MODULES)} of "
                                 "each layer).")
            halves.setdefault(module, {})[half] = tensor
        loras = {}
        for module, ab in halves.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"{weights_path}: module {module!r} has lora_{''.join(ab)} only; "
                                 "both lora_A and lora_B are needed.")
            n_in, n_out = expected_modules[module]
            for half, want in (("A", (r, n_in)), ("B", (n_out, r))):
                if tuple(ab[half].shape) != want:
                    raise ValueError(f"{weights_path}: {module}.lora_{half}.weight has shape "
                                     f"{tuple(ab[half].shape)}, expected {want} (r={r}, the "
                                     f"module is {n_in} -> {n_out}).")
            loras[module] = LoRALayerWeights(module, ab["A"].to(dtype),
                                             (ab["B"].double() * scaling).to(dtype))
        if not loras:
            raise ValueError(f"{weights_path}: holds no LoRA weights.")
        return cls(lora_int_id, name, r, scaling, loras)


class LoRAModelManager:
    """The adapters registered (host memory, at most ``max_cpu_loras``) and active (device
    slots 1..``max_loras``; slot 0 is "no adapter").

    Invariants: an active adapter is registered; ``slot_of`` and ``slots`` are inverse; a
    pinned adapter is never evicted from either cache (pinning activates it); eviction is
    least-recently-used among the unpinned adapters outside the batch being set up.
    ``write_slot(slot, model)`` / ``clear_slot(slot)`` copy weights to the device layers.
    """

    def __init__(self, max_loras: int, max_cpu_loras: int,
                 write_slot: Callable[[int, LoRAModel], None], clear_slot: Callable[[int], None]) -> None:
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self.registered: OrderedDict[int, LoRAModel] = OrderedDict()  # LRU order, oldest first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # active id -> slot, LRU order
        self.slots: list[int | None] = [None] * (max_loras + 1)
        self.pinned: set[int] = set()
        self._write, self._clear = write_slot, clear_slot

    def list_adapters(self) -> set[int]:
        return set(self.registered)

    def add_adapter(self, model: LoRAModel) -> bool:
        """Register; False if its id is registered already. Evicts the LRU unpinned adapter
        when host memory is full (RuntimeError if every registered one is pinned)."""
        if model.id in self.registered:
            self.registered.move_to_end(model.id)
            return False
        if len(self.registered) >= self.max_cpu_loras:
            victim = next((i for i in self.registered if i not in self.pinned), None)
            if victim is None:
                raise RuntimeError(f"All {self.max_cpu_loras} CPU LoRA slots (max_cpu_loras) hold "
                                   "pinned adapters.")
            self.remove_adapter(victim)
        self.registered[model.id] = model
        return True

    def remove_adapter(self, lora_id: int) -> bool:
        if lora_id not in self.registered:
            return False
        self._deactivate(lora_id)
        del self.registered[lora_id]
        self.pinned.discard(lora_id)
        return True

    def pin_adapter(self, lora_id: int) -> bool:
        if lora_id not in self.registered:
            raise ValueError(f"Pinning failed. LoRA {lora_id} is not registered.")
        self.activate([lora_id])
        self.pinned.add(lora_id)
        return True

    def activate(self, lora_ids: Iterable[int]) -> dict[int, int]:
        """Give every adapter of a batch a device slot (each registered); returns id -> slot."""
        batch = list(dict.fromkeys(lora_ids))
        if len(batch) > self.max_loras:
            raise RuntimeError(f"A batch uses {len(batch)} adapters > max_loras={self.max_loras}.")
        for lora_id in batch:
            self.registered.move_to_end(lora_id)
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
                continue
            free = next((s for s in range(1, self.max_loras + 1) if self.slots[s] is None), None)
            if free is None:
                victim = next((i for i in self.slot_of if i not in self.pinned and i not in batch), None)
                if victim is None:
                    raise RuntimeError(f"No free LoRA slot for adapter {lora_id}: all max_loras="
                                       f"{self.max_loras} slots are pinned or in this batch.")
                free = self._deactivate(victim)
            self._write(free, self.registered[lora_id])
            self.slots[free] = lora_id
            self.slot_of[lora_id] = free
        return {i: self.slot_of[i] for i in batch}

    def _deactivate(self, lora_id: int) -> int | None:
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self._clear(slot)
            self.slots[slot] = None
        return slot
