"""Prefill/decode disaggregation in a cluster: xPyD pools, vLLM's proxy flow, llm-d's decider.

``Cluster(prefill=[...], decode=[...], router="pd_proxy")`` makes the first replicas KV
producers (``engine_id`` ``prefill-i``) and the rest KV consumers (``decode-j``), all with the
in-process connector over one modelled link (``link``: ``kv_connector_extra_config`` keys such
as ``link_bandwidth_gbps``).

The flow, as vLLM's disaggregated-serving proxy: the request goes to a prefill replica with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": True}``; when that leg
finishes (on the prefill replica's clock), the request goes to the chosen decode replica
with its own parameters and the ``kv_transfer_params`` the prefill returned, arriving then
but keeping its original arrival time, so its TTFT counts the prefill, the transfer and both
queues. Only the decode leg is the request's row in the result.

:class:`PDProxy` picks the least loaded replica of each pool (ties: lowest index) and, as
llm-d's P/D decider, disaggregates only when the prompt's part not already cached on the
chosen decode replica is longer than ``threshold`` tokens; otherwise the decode replica
serves the request alone (its :class:`PDRouting` has ``decode=None``).

Invariant: every request is finished by exactly one replica; a prefill leg's blocks stay
held until its decode leg has read them (or was refused), then are freed.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from workbench.cluster.replica import ReplicaView
from workbench.cluster.router import RoutedRequest, Router, Routing, lowest
from workbench.config import KVTransferConfig
from workbench.lab.run import resolve_config
from workbench.request import Request


@dataclass(frozen=True)
class PDRouting(Routing):
    """``replica``: where the prompt is computed (a prefill replica, or -- ``decode`` None --
    the decode replica that serves the request whole); ``decode``: the decode replica."""

    decode: int | None = None


def pd_configs(prefill: Sequence, decode: Sequence, link: dict | None = None) -> list:
    """The replicas' configs: ``prefill`` as KV producers, then ``decode`` as KV consumers."""
    for name, pool in (("prefill", prefill), ("decode", decode)):
        if isinstance(pool, (str, bytes)) or not isinstance(pool, Sequence) or not pool:
            raise ValueError(f"{name} must be a non-empty list of EngineArgs (or dicts of overrides), got {pool!r}.")
    extra = dict(link or {})
    configs = []
    for role, name, pool in (("kv_producer", "prefill", prefill), ("kv_consumer", "decode", decode)):
        for i, config in enumerate(pool):
            config = resolve_config(config)
            kv = KVTransferConfig(kv_role=role, engine_id=f"{name}-{i}", kv_connector_extra_config=extra)
            configs.append(dataclasses.replace(config, kv_transfer_config=kv))
    return configs


def kv_role(view: ReplicaView) -> str | None:
    kv = view.engine.config.kv_transfer_config
    return None if kv is None else kv.kv_role


def cached_prefix_tokens(view: ReplicaView, prompt_token_ids: Sequence[int]) -> int:
    """Prompt tokens the replica's prefix cache holds now (read from its live KV cache)."""
    probe = Request("pd-decider-probe", list(prompt_token_ids))
    return view.engine.kv_cache.get_computed_blocks(probe)[1]


class PDProxy(Router):
    """See the module docstring. ``threshold``: the fewest uncached prompt tokens worth a
    prefill replica (0: always disaggregate)."""

    name = "pd_proxy"

    def __init__(self, threshold: int = 0) -> None:
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise ValueError(f"threshold must be an integer >= 0 (tokens), got {threshold!r}.")
        self.threshold = threshold

    def route(self, request: RoutedRequest, replicas: Sequence[ReplicaView]) -> PDRouting:
        prefill = [v for v in replicas if kv_role(v) == "kv_producer"]
        decode = [v for v in replicas if kv_role(v) == "kv_consumer"]
        if not prefill or not decode:
            raise ValueError("pd_proxy needs prefill and decode replicas: Cluster(prefill=[...], decode=[...]).")
        d = decode[lowest([v.num_requests for v in decode])]
        p = prefill[lowest([v.num_requests for v in prefill])]
        uncached = len(request.prompt_token_ids) - cached_prefix_tokens(d, request.prompt_token_ids)
        scores = {"requests": [v.num_requests for v in replicas],
                  "uncached": [float(uncached if v.index == d.index else 0) for v in replicas]}
        if uncached <= self.threshold:
            return PDRouting(d.index, scores, decode=None)
        return PDRouting(p.index, scores, decode=d.index)


class PDLegs:
    """A cluster run's decode legs waiting for their prefill legs (see the module docstring)."""

    def __init__(self) -> None:
        self.pending: dict[str, tuple[object, float, int]] = {}  # id -> (request, arrival, decode replica)
        self.prefill_legs: dict[int, set[str]] = {}  # replica -> ids computed there as prefill legs
        self.handoffs: list[tuple] = []  # heap of (time, seq, id, prefill replica, prefill output)

    def start(self, run, request, arrival: float, prefill: int, decode: int) -> None:
        """Send the prefill leg (max_tokens=1, do_remote_decode) to replica ``prefill``."""
        params = request.params
        extra = {**(params.extra_args or {}), "kv_transfer_params": {"do_remote_decode": True}}
        leg = dataclasses.replace(request, params=dataclasses.replace(params, max_tokens=1, min_tokens=0,
                                                                      extra_args=extra))
        self.pending[request.request_id] = (request, arrival, decode)
        self.prefill_legs.setdefault(prefill, set()).add(request.request_id)
        run._add(run.replicas[prefill], leg, arrival)

    def on_finished(self, run, replica, out) -> bool:
        """A finished output of ``replica``: True when it ends a prefill leg (its decode leg is
        handed off at this replica's clock, like an arrival); False for a request's final output."""
        rid = out.request_id
        if rid not in self.prefill_legs.get(replica.index, ()) or rid not in self.pending:
            return False
        heapq.heappush(self.handoffs, (replica.now, len(self.handoffs), rid, replica.index, out))
        return True

    def next_handoff(self) -> float:
        return self.handoffs[0][0] if self.handoffs else math.inf

    def deliver(self, run) -> None:
        """Add the earliest handed-off decode leg to its decode replica (at the handoff time:
        the cluster loop calls this once every busy replica's clock has reached it)."""
        when, _, rid, prefill, out = heapq.heappop(self.handoffs)
        replica = run.replicas[prefill]
        request, arrival, decode = self.pending.pop(rid)
        target = run.replicas[decode]
        target.idle_until(when)
        params = request.params
        extra = {**(params.extra_args or {}), "kv_transfer_params": out.kv_transfer_params or {}}
        try:
            target.engine.add_request(rid, {"prompt_token_ids": list(out.prompt_token_ids)},
                                      dataclasses.replace(params, extra_args=extra), arrival_time=arrival,
                                      priority=request.priority if target.engine.uses_priority else 0)
        except ValueError as e:
            run.rejected[rid] = str(e)
            if out.kv_transfer_params:  # no consumer will read them: release the blocks now
                replica.engine.runner.connector.notify_read(rid, when)
        for changed in (target, replica):  # the loop's views and busy list read them afresh
            changed.changed()
            run.busy[changed.index] = changed.busy

    def final_rows(self, index: int, frame):
        """A replica's request rows without its prefill legs."""
        legs = self.prefill_legs.get(index)
        if not legs or not len(frame):
            return frame
        return frame[~frame["request_id"].isin(legs)].reset_index(drop=True)
