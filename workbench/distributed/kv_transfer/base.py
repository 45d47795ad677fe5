"""KVConnectorBase_V1: vLLM's KV connector, one class with two halves chosen by ``role``.

The scheduler side (torch-free; the scheduler calls it):

* ``get_num_new_matched_tokens(request, num_computed_tokens)`` -> ``(num_external_tokens,
  load_kv_async)``: how many tokens past the local prefix hit a peer can supply, and whether
  they arrive asynchronously (the request then waits in WAITING_FOR_REMOTE_KVS);
* ``update_state_after_alloc(request, block_ids, num_external_tokens)``: the blocks the
  external tokens will land in;
* ``build_connector_meta(scheduler_output)``: what the worker side must do this step;
* ``request_finished(request, block_ids)`` -> ``(delay_free_blocks, kv_transfer_params)``:
  a producer holds a finished request's blocks until a peer has read them, and the params
  tell that peer where they are.

The worker side (runs beside the model runner, sees the KV tensors):
``register_kv_caches``, ``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``,
``wait_for_save`` and ``get_finished(finished_req_ids)`` -> ``(finished_sending,
finished_recving)``, the request ids whose transfers completed; they travel back to the
scheduler in the step's :class:`KVConnectorOutput`.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """What the scheduler side tells the worker side each step (a connector subclasses it)."""


@dataclass(frozen=True)
class KVTransfer:
    """One finished (or started) transfer of a request's blocks, in the consumer's clock:
    from ``remote_engine_id``'s request ``remote_request_id`` into ``engine_id``'s
    ``request_id``; ``start`` / ``end`` the modelled interval on the link."""

    request_id: str
    engine_id: str
    remote_request_id: str
    remote_engine_id: str
    num_blocks: int
    num_bytes: int
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class KVConnectorOutput:
    """vLLM's: the ids whose sending (this engine, a producer, may free their held blocks) and
    receiving (their blocks are in: the request may run) completed, and the transfers this
    engine started in the step (for the records)."""

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    transfers: tuple[KVTransfer, ...] = ()


class KVConnectorBase_V1(abc.ABC):  # noqa: N801 (vLLM's name)
    """See the module docstring; ``config`` is the engine's KVTransferConfig."""

    def __init__(self, config, role: KVConnectorRole) -> None:
        self.config = config
        self.role = role
        self._metadata: KVConnectorMetadata | None = None

    # ------------------------------------------------------------ worker side
    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata | None:
        return self._metadata

    def register_kv_caches(self, kv_caches) -> None:
        """The runner's per-layer (key_cache, value_cache) tensors (None: a runner without any)."""

    @abc.abstractmethod
    def start_load_kv(self, **kwargs) -> None:
        """Start the loads the bound metadata asks for (before the forward pass)."""

    @abc.abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV is loaded (a layer-by-layer connector)."""

    @abc.abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata) -> None:
        """Start saving ``layer_name``'s KV (a push connector)."""

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """Block until the step's saves are done (after the forward pass)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) since the last call."""
        return set(), set()

    # ------------------------------------------------------------ scheduler side
    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens a peer supplies past ``num_computed_tokens``, whether they load asynchronously)."""

    @abc.abstractmethod
    def update_state_after_alloc(self, request, block_ids: tuple[int, ...], num_external_tokens: int) -> None:
        """The request's block table after allocating room for its external tokens."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """This step's work for the worker side; resets what it drained."""

    def request_finished(self, request, block_ids: tuple[int, ...]) -> tuple[bool, dict | None]:
        """(delay freeing ``block_ids`` until sent, the params returned in the request's output)."""
        return False, None
