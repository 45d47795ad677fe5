"""Every candidate's state at every routing decision of a run, read by replaying it.

``candidate_states(result)`` runs the result's cluster again on its workload with every
request forced to the replica it went to (so the assignments are the run's, whatever the
router would say on a wall clock measured anew) and the router still asked; at each
arrival it reads every replica as the router saw it. One row per (decision, replica):

* ``decision`` (its index), ``arrival``, ``request_id``, ``prompt_tokens``, ``replica``, ``chosen`` (the request
  went there), ``router_choice`` (what the router said: differs where a fork forced another);
* ``num_requests`` / ``num_waiting`` / ``num_running``, ``kv_usage``: the replica's
  :class:`~workbench.cluster.replica.ReplicaView`;
* ``cached_tokens``: the prompt's leading tokens the replica's prefix cache holds at that
  moment (full blocks, at most ``len - 1`` tokens, as the scheduler's lookup), and
  ``prefix_match`` = cached_tokens / prompt tokens: what the request would find there;
* ``score_{name}``: each score the router compared, for that replica.

Simulated runs (and real ones on the step clock) replay exactly, so the states are the
run's own; a real cluster on the wall clock replays the same assignments on newly measured
step times.
"""

from __future__ import annotations

import copy

import pandas as pd

from workbench.cluster.router import Router
from workbench.core.kv_cache_utils import hash_request_blocks


def cached_tokens(engine, tokens, lora_name: str | None = None) -> int:
    """How many leading tokens of ``tokens`` the engine's prefix cache holds (full blocks)."""
    kv = engine.kv_cache
    if not kv.enable_prefix_caching:
        return 0
    bs = kv.block_size
    max_blocks = (len(tokens) - 1) // bs
    n = 0
    for i, h in enumerate(hash_request_blocks(tokens[:max_blocks * bs], bs, lora_name=lora_name)):
        block = kv.pool.get_cached_block(h)
        if block is None or block.token_ids != tuple(tokens[i * bs:(i + 1) * bs]):
            break
        n += 1
    return n * bs


class _Watching(Router):
    """Routes as ``inner`` and records every candidate's state (the rows survive the
    cluster's deep copy of its router: they are shared, not copied)."""

    def __init__(self, inner: Router, rows: list) -> None:
        self.inner, self.rows = inner, rows
        self.name, self.reads_kv_events = inner.name, inner.reads_kv_events

    def __deepcopy__(self, memo):
        return _Watching(copy.deepcopy(self.inner, memo), self.rows)

    def route(self, request, replicas):
        answer = self.inner.route(request, replicas)
        tokens = request.prompt_token_ids
        lora = request.request.lora_request
        lora_name = lora.lora_name if lora is not None else None
        decision = len(self.rows) // len(replicas) if replicas else 0
        for v in replicas:
            hits = cached_tokens(v.engine, tokens, lora_name)
            self.rows.append({"decision": decision, "arrival": request.arrival, "request_id": request.request_id,
                              "prompt_tokens": len(tokens), "replica": v.index, "num_requests": v.num_requests, "num_waiting": v.num_waiting,
                              "num_running": v.num_running, "kv_usage": v.kv_usage, "cached_tokens": hits,
                              "prefix_match": hits / len(tokens) if tokens else 0.0})
        return answer

    def on_kv_events(self, replica, batch):
        self.inner.on_kv_events(replica, batch)

    def on_finished(self, replica, request_id):
        self.inner.on_finished(replica, request_id)


def candidate_states(result) -> pd.DataFrame:
    """One row per (decision, replica) of ``result`` (a ClusterResult; see the module docstring)."""
    rows: list[dict] = []
    forced = {d["request_id"]: d["replica"] for d in result.decision_rows}
    cluster = result.cluster.with_router(_Watching(result.cluster.router, rows))
    cluster.run(result.workload, forced=forced)
    frame = pd.DataFrame(rows)
    if not len(frame):
        return frame
    decisions = result.decision_rows
    frame["chosen"] = [decisions[d]["replica"] == r for d, r in zip(frame["decision"], frame["replica"])]
    frame["router_choice"] = [decisions[d]["router_choice"] for d in frame["decision"]]
    names = sorted({k.rsplit("_", 1)[0] for d in decisions[:1] for k in d
                    if k not in ("arrival", "request_id", "router_choice", "replica")})
    for name in names:
        frame[f"score_{name}"] = [decisions[d].get(f"{name}_{r}") for d, r in zip(frame["decision"], frame["replica"])]
    return frame
