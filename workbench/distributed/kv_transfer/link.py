"""KVLink: the modelled wire between two engines, and how long a transfer takes on it."""

from __future__ import annotations

from dataclasses import dataclass

#: ``kv_connector_extra_config`` keys that set the link (and their KVLink fields).
LINK_KEYS = {"link_bandwidth_gbps": "bandwidth_gbps", "link_latency_s": "latency_s",
             "link_per_block_s": "per_block_s"}


@dataclass(frozen=True)
class KVLink:
    """A point-to-point link: ``bandwidth_gbps`` (gigabits per second), ``latency_s`` (paid
    once per transfer) and ``per_block_s`` (a descriptor's cost per block, as RDMA reads of
    non-contiguous blocks pay). Invariant: all finite, bandwidth > 0, the others >= 0.

    ``transfer_time(num_blocks, num_bytes) = latency_s + num_blocks * per_block_s
    + num_bytes * 8 / (bandwidth_gbps * 1e9)``; a transfer of no block takes no time."""

    bandwidth_gbps: float = 100.0
    latency_s: float = 1e-4
    per_block_s: float = 1e-6

    def __post_init__(self) -> None:
        if not (isinstance(self.bandwidth_gbps, (int, float)) and 0 < self.bandwidth_gbps < float("inf")):
            raise ValueError(f"link_bandwidth_gbps must be a number > 0, got {self.bandwidth_gbps!r}.")
        for name in ("latency_s", "per_block_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
                raise ValueError(f"link_{name} must be a number >= 0, got {value!r}.")

    @classmethod
    def from_extra_config(cls, extra: dict) -> KVLink:
        """The link ``kv_connector_extra_config`` describes (absent keys keep the defaults)."""
        return cls(**{field: extra[key] for key, field in LINK_KEYS.items() if key in extra})

    def transfer_time(self, num_blocks: int, num_bytes: int) -> float:
        if num_blocks <= 0:
            return 0.0
        return self.latency_s + num_blocks * self.per_block_s + num_bytes * 8 / (self.bandwidth_gbps * 1e9)
