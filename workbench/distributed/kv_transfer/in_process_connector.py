"""InProcessConnector: KV blocks copied tensor by tensor between two engines of one process,
timed by a modelled link.

A pull connector, like vLLM's NIXL one. The producer (``kv_producer``/``kv_both``) finishes a
request that asked ``do_remote_decode`` (the proxy's ``max_tokens=1`` prefill) holding its
blocks, and returns ``{"do_remote_prefill": True, "remote_engine_id", "remote_request_id",
"remote_block_ids"}``. The consumer, given those params, allocates blocks for the prompt's
first ``num_prompt_tokens - 1`` tokens past its own prefix hit (the last prompt token is
recomputed, to sample from), waits in WAITING_FOR_REMOTE_KVS, and its worker side copies
the producer's blocks into them, layer by layer, at ``start_load_kv``. The data is there at
once; the request becomes runnable when the consumer's clock passes the transfer's modelled
end (:class:`~workbench.distributed.kv_transfer.link.KVLink`), and then the producer is told,
with that time, and frees its blocks once its own clock passes it. A producer that is never
told frees them after ``abort_timeout_s`` (vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``).

Invariants: a consumer loads a request's remote blocks at most once (after a preemption it
recomputes); every block a producer holds is freed once (told, or timed out); a copy reads
only blocks the producer still holds.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from workbench.distributed.kv_transfer.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                   KVConnectorRole, KVTransfer)
from workbench.distributed.kv_transfer.link import LINK_KEYS, KVLink

#: The worker sides of this process's connectors, by engine_id (a request's remote_engine_id).
_WORKERS: weakref.WeakValueDictionary[str, InProcessConnector] = weakref.WeakValueDictionary()

#: vLLM's default abort timeout (seconds a producer holds blocks no consumer reads).
DEFAULT_ABORT_TIMEOUT_S = 480.0
_EXTRA_KEYS = set(LINK_KEYS) | {"abort_timeout_s"}


@dataclass(frozen=True)
class ReqToRecv:
    """Blocks to read: the producer's ``remote_block_ids`` into this engine's ``block_ids``."""

    request_id: str
    remote_engine_id: str
    remote_request_id: str
    block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]


@dataclass
class InProcessConnectorMetadata(KVConnectorMetadata):
    reqs_to_recv: list[ReqToRecv] = field(default_factory=list)
    #: Producer: finished requests whose blocks are held, {id: block ids}.
    reqs_to_send: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: Consumer: remote requests to release without reading ({remote engine: [remote ids]}).
    reqs_to_release: list[tuple[str, str]] = field(default_factory=list)


class InProcessConnector(KVConnectorBase_V1):
    """See the module docstring. ``engine_id`` names this engine; ``clock`` is its clock;
    ``block_size`` its tokens per block; ``bytes_per_block`` one block's size over all layers
    (keys and values)."""

    def __init__(self, config, role: KVConnectorRole, *, engine_id: str, clock, block_size: int,
                 bytes_per_block: int) -> None:
        super().__init__(config, role)
        extra = dict(config.kv_connector_extra_config)
        unknown = sorted(set(extra) - _EXTRA_KEYS)
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config: unknown keys {unknown}; "
                             f"known: {sorted(_EXTRA_KEYS)}.")
        self.link = KVLink.from_extra_config(extra)
        self.abort_timeout_s = float(extra.get("abort_timeout_s", DEFAULT_ABORT_TIMEOUT_S))
        if not self.abort_timeout_s > 0:
            raise ValueError(f"abort_timeout_s must be > 0, got {self.abort_timeout_s!r}.")
        self.engine_id, self.clock = engine_id, clock
        self.block_size, self.bytes_per_block = block_size, bytes_per_block
        # scheduler side
        self._reqs_to_recv: dict[str, ReqToRecv] = {}
        self._reqs_to_send: dict[str, tuple[int, ...]] = {}
        self._reqs_to_release: list[tuple[str, str]] = []
        self._loaded: set[str] = set()  # requests whose remote params were used (once)
        # worker side
        self.kv_caches = None
        self._recving: dict[str, tuple[float, str, str]] = {}  # id -> (end, remote engine, remote id)
        self._sending: dict[str, float] = {}  # held id -> abort deadline
        self._notified: dict[str, float] = {}  # held id -> when its consumer finished reading
        self._transfers: list[KVTransfer] = []  # started since the last take_transfers()
        if role is KVConnectorRole.WORKER:
            _WORKERS[engine_id] = self

    # ------------------------------------------------------------ scheduler side
    def check_request(self, request) -> None:
        """Raise ValueError naming the field when a request's ``kv_transfer_params`` are malformed."""
        params = request.kv_transfer_params
        if params is None:
            return
        if not isinstance(params, dict):
            raise ValueError(f"kv_transfer_params must be a dict, got {type(params).__name__}.")
        if params.get("do_remote_prefill"):
            for key, kind in (("remote_engine_id", str), ("remote_request_id", str), ("remote_block_ids", list)):
                if not isinstance(params.get(key), kind):
                    raise ValueError(f"kv_transfer_params.{key} must be a {kind.__name__} with "
                                     f"do_remote_prefill, got {params.get(key)!r}.")
            if not all(isinstance(b, int) and b >= 0 for b in params["remote_block_ids"]):
                raise ValueError("kv_transfer_params.remote_block_ids must be block ids (integers >= 0).")

    def _remote(self, request) -> dict | None:
        """The request's ``do_remote_prefill`` params if it should load them now (once)."""
        params = request.kv_transfer_params
        if (not params or not params.get("do_remote_prefill") or not self.config.is_kv_consumer
                or request.request_id in self._loaded):
            return None
        return params

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """All prompt tokens but the last past the local hit, loaded asynchronously, when the
        request carries a producer's params this engine can read (its peer is in this process,
        holds enough blocks of the same size); otherwise 0 (it prefills locally, and the
        producer is told to release its blocks)."""
        params = self._remote(request)
        if params is None:
            return 0, False
        block_size = self.block_size
        need = -(-(request.num_prompt_tokens - 1) // block_size)
        peer = _WORKERS.get(params["remote_engine_id"])
        count = request.num_prompt_tokens - 1 - num_computed_tokens
        if (peer is None or peer.bytes_per_block != self.bytes_per_block
                or len(params["remote_block_ids"]) < need or count <= 0):
            self._reqs_to_release.append((params["remote_engine_id"], params["remote_request_id"]))
            self._loaded.add(request.request_id)
            return 0, False
        return count, True

    def update_state_after_alloc(self, request, block_ids: tuple[int, ...], num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        self._loaded.add(request.request_id)
        params = request.kv_transfer_params
        block_size = self.block_size
        end = -(-(request.num_prompt_tokens - 1) // block_size)
        first = (request.num_prompt_tokens - 1 - num_external_tokens) // block_size  # past the local hit
        self._reqs_to_recv[request.request_id] = ReqToRecv(
            request.request_id, params["remote_engine_id"], params["remote_request_id"],
            tuple(block_ids[first:end]), tuple(params["remote_block_ids"][first:end]))

    def build_connector_meta(self, scheduler_output) -> InProcessConnectorMetadata:
        meta = InProcessConnectorMetadata(list(self._reqs_to_recv.values()), self._reqs_to_send,
                                          self._reqs_to_release)
        self._reqs_to_recv, self._reqs_to_send, self._reqs_to_release = {}, {}, []
        return meta

    def request_finished(self, request, block_ids: tuple[int, ...]) -> tuple[bool, dict | None]:
        """A producer's length-capped ``do_remote_decode`` request: hold its blocks, return
        where they are. A consumer's request that ends before its load was handed to the worker
        releases the producer's blocks."""
        rid = request.request_id
        params = request.kv_transfer_params
        pending = self._reqs_to_recv.pop(rid, None)
        if pending is not None or (self._remote(request) is not None):  # never read: release
            self._reqs_to_release.append((params["remote_engine_id"], params["remote_request_id"]))
        self._loaded.discard(rid)
        if (not params or not params.get("do_remote_decode") or not self.config.is_kv_producer
                or request.status.finish_reason != "length" or not block_ids):
            return False, None
        self._reqs_to_send[rid] = tuple(block_ids)
        return True, {"do_remote_decode": False, "do_remote_prefill": True,
                      "remote_engine_id": self.engine_id, "remote_request_id": rid,
                      "remote_block_ids": list(block_ids)}

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches) -> None:
        self.kv_caches = kv_caches or None

    def start_load_kv(self, **kwargs) -> None:
        """Copy each request's blocks from its producer, layer by layer; its modelled end is
        now + the link's time for them."""
        meta = self._get_connector_metadata()
        if meta is None:
            return
        now = self.clock()
        for rid in meta.reqs_to_send:
            self._sending[rid] = now + self.abort_timeout_s
        for engine_id, remote_rid in meta.reqs_to_release:
            peer = _WORKERS.get(engine_id)
            if peer is not None:
                peer.notify_read(remote_rid, now)
        for req in meta.reqs_to_recv:
            peer = _WORKERS[req.remote_engine_id]
            if self.kv_caches is not None and peer.kv_caches is not None:
                import torch  # KV tensors to copy: a real model runs (a simulated one has none)

                dst = torch.tensor(req.block_ids, dtype=torch.long)
                src = torch.tensor(req.remote_block_ids, dtype=torch.long)
                for (key, value), (peer_key, peer_value) in zip(self.kv_caches, peer.kv_caches):
                    key[dst.to(key.device)] = peer_key[src.to(peer_key.device)].to(key.device)
                    value[dst.to(value.device)] = peer_value[src.to(peer_value.device)].to(value.device)
            n = len(req.block_ids)
            num_bytes = n * self.bytes_per_block
            end = now + self.link.transfer_time(n, num_bytes)
            self._recving[req.request_id] = (end, req.remote_engine_id, req.remote_request_id)
            self._transfers.append(KVTransfer(req.request_id, self.engine_id, req.remote_request_id,
                                              req.remote_engine_id, n, num_bytes, now, end))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: ``start_load_kv`` copied every layer."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata) -> None:
        """Nothing to push: the consumer pulls the blocks the producer holds."""

    def wait_for_save(self) -> None:
        """Nothing to wait for (a pull connector)."""

    def notify_read(self, request_id: str, when: float) -> None:
        """A consumer finished reading this producer's ``request_id`` at ``when`` (its clock)."""
        self._notified[request_id] = when

    def next_arrival(self) -> float | None:
        """The earliest known time a transfer completes here: a load in flight ends, or a
        consumer finished reading blocks this engine holds; None when none is known."""
        ends = [end for end, _, _ in self._recving.values()]
        ends += [self._notified[rid] for rid in self._sending if rid in self._notified]
        return min(ends, default=None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Loads whose modelled end has passed (their producers are told, at that end), and held
        requests whose consumer finished reading by now or whose abort deadline passed."""
        now = self.clock()
        recving = {rid for rid, (end, _, _) in self._recving.items() if end <= now + 1e-12}
        for rid in recving:
            end, engine_id, remote_rid = self._recving.pop(rid)
            peer = _WORKERS.get(engine_id)
            if peer is not None:
                peer.notify_read(remote_rid, end)
        sending = {rid for rid, deadline in self._sending.items()
                   if self._notified.get(rid, deadline) <= now or deadline <= now}
        for rid in sending:
            del self._sending[rid]
            self._notified.pop(rid, None)
        return sending, recving

    def take_transfers(self) -> tuple[KVTransfer, ...]:
        transfers, self._transfers = tuple(self._transfers), []
        return transfers
