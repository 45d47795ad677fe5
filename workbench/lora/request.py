"""LoRARequest: which adapter a request runs under (vLLM's type and names; no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class LoRARequest:
    """A LoRA adapter by name, integer id and PEFT directory (``adapter_config.json`` and
    ``adapter_model.safetensors``).

    Invariants (vLLM's): ``lora_int_id >= 1`` (0 is "no adapter", the runner's slot 0), the
    name is a non-empty string. Two requests are the same adapter iff their names are equal
    (vLLM compares and hashes by ``lora_name``; the prefix cache keys blocks by it too).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    #: The model the adapter was trained on (``/v1/models``' ``parent``); None: the served one.
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}.")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) \
                or self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    def __repr__(self) -> str:
        return f"LoRARequest(lora_name={self.lora_name!r}, lora_int_id={self.lora_int_id})"
