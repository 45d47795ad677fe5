"""The scheduler's side of KV transfer (vLLM's scheduler with a KV connector), as a mixin of
:class:`~workbench.core.sched.scheduler.Scheduler`; the connector is any object with
KVConnectorBase_V1's scheduler-side methods (the core imports no connector).

* Admission: a waiting request whose connector reports remote tokens past its prefix hit
  (``get_num_new_matched_tokens``) gets blocks for hit + remote tokens, the connector is told
  (``update_state_after_alloc``) and the request waits in WAITING_FOR_REMOTE_KVS, passed over.
* When the worker side reports it received (``finished_recving``), the next ``schedule()``
  sets its ``num_computed_tokens`` to those tokens, caches the full blocks and makes it WAITING:
  it is admitted like a prefix hit, computing the rest of its prompt.
* Finish: ``request_finished`` may keep the blocks (``held_for_transfer``) until the worker
  reports them sent (``finished_sending``); the connector's params go on the request's output.

Invariants: a request in WAITING_FOR_REMOTE_KVS holds blocks for exactly
``remote_kv_tokens[id]`` tokens and ``num_computed_tokens == 0``; a WAITING request with
``num_computed_tokens > 0`` received them and holds ``ceil(num_computed_tokens / block_size)``
blocks; a held request is finished and in no queue; it is freed exactly once.
"""

from __future__ import annotations

from workbench.request import Request, RequestStatus


class RemoteKVMixin:
    """Needs ``kv_cache``, ``requests``, ``waiting`` and ``connector`` (None: nothing happens)."""

    def _init_remote_kv(self, connector) -> None:
        #: The KV connector's scheduler side, else None.
        self.connector = connector
        #: Finished requests whose blocks wait to be read by a peer engine, by id.
        self.held_for_transfer: dict[str, Request] = {}
        #: Requests in WAITING_FOR_REMOTE_KVS: the tokens their blocks will hold, by id.
        self.remote_kv_tokens: dict[str, int] = {}
        self._finished_recving: set[str] = set()

    def _check_remote_kv(self, request: Request) -> None:
        """Refuse (ValueError naming the field) malformed ``kv_transfer_params`` at admission."""
        if self.connector is not None:
            self.connector.check_request(request)

    def _load_remote_kv(self, request: Request, hit_blocks, num_hit: int) -> bool | None:
        """Ask the connector; True: the request now waits for remote KV; False: admit it as
        usual; None: no room for its blocks now."""
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit)
        if not (num_external and load_async):
            return False
        if self.kv_cache.allocate_slots(request, num_external, hit_blocks) is None:
            return None
        self.connector.update_state_after_alloc(request, self.kv_cache.block_ids(request.request_id), num_external)
        self.remote_kv_tokens[request.request_id] = num_hit + num_external
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        return True

    def _update_waiting_for_remote_kv(self) -> None:
        """vLLM's name: requests whose KV arrived become WAITING with those tokens computed."""
        for rid in self._finished_recving:
            request = self.requests.get(rid)
            if request is None or request.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            request.num_computed_tokens = self.remote_kv_tokens.pop(rid)
            self.kv_cache.cache_blocks(request, request.num_computed_tokens)
            request.status = RequestStatus.WAITING
        self._finished_recving = set()

    def _update_from_kv_xfer_finished(self, kv_connector_output) -> None:
        """vLLM's name: note the received requests, free the sent ones' held blocks."""
        if kv_connector_output is None:
            return
        self._finished_recving |= kv_connector_output.finished_recving
        for rid in kv_connector_output.finished_sending:
            request = self.held_for_transfer.pop(rid, None)
            if request is not None:
                self.kv_cache.free(request)

    def _connector_finished(self, request: Request) -> bool:
        """Tell the connector a request finished; True when it keeps the blocks."""
        self.remote_kv_tokens.pop(request.request_id, None)
        delay, params = self.connector.request_finished(request, self.kv_cache.block_ids(request.request_id))
        request.output_kv_transfer_params = params
        if delay:
            self.held_for_transfer[request.request_id] = request
        return delay

    def has_kv_transfers(self) -> bool:
        """Blocks held for a peer (the engine must keep stepping to learn they were read)."""
        return bool(self.held_for_transfer)
