"""The Router protocol: which replica serves an arriving request, and why.

A router is a small object a user can subclass in a notebook (as the scheduler's
:class:`~workbench.core.sched.policies.SchedulingPolicy`)::

    class FewestWaiting(Router):
        name = "fewest_waiting"
        def route(self, request, replicas):
            waiting = [r.num_waiting for r in replicas]
            return Routing(waiting.index(min(waiting)), {"waiting": waiting})

    Cluster.simulated(4, router=FewestWaiting()).run(workload)

* ``route(request, replicas)`` gets the arriving :class:`RoutedRequest` and one
  :class:`~workbench.cluster.replica.ReplicaView` per replica (index order) and returns a
  :class:`Routing`: the chosen index and the scores it compared, by name, one value per
  replica (every decision keeps them: ``ClusterResult.decisions``). An int is a Routing
  with no scores.
* ``on_kv_events(replica, batch)``: the KV events a replica published in its last step (a
  vLLM :class:`~workbench.core.kv_event_batch.KVEventBatch`), for routers that set
  ``reads_kv_events = True``; ``on_finished(replica, request_id)``: a request finished.

A cluster run starts from a deep copy of the router it was given, so a router's state (a
round robin's position, a tree) is the run's own and a run can be repeated.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from workbench.cluster.replica import ReplicaView
from workbench.lab.workload import WorkloadRequest


@dataclass
class RoutedRequest:
    """An arriving request as a router sees it: its id, workload request, arrival (on the
    workload's clock) and its prompt's token ids (tokenized on first use when the prompt is
    text, with the replicas' tokenizer)."""

    request_id: str
    request: WorkloadRequest
    arrival: float
    _tokenize: object = field(default=None, repr=False)

    @functools.cached_property
    def prompt_token_ids(self) -> tuple[int, ...]:
        prompt = self.request.prompt
        return prompt if isinstance(prompt, tuple) else tuple(self._tokenize(prompt))


@dataclass(frozen=True)
class Routing:
    """A router's answer: ``replica`` (its index) and ``scores``: name -> one value per
    replica, in index order (what the choice was made from)."""

    replica: int
    scores: dict[str, Sequence[float]] = field(default_factory=dict)


class Router:
    """Base router: override :meth:`route`. ``name`` labels its decisions and results."""

    name = "router"
    #: Whether the cluster hands this router every replica's KV events (costs a little per step).
    reads_kv_events = False

    def route(self, request: RoutedRequest, replicas: Sequence[ReplicaView]) -> Routing | int:
        raise NotImplementedError(f"{type(self).__name__}.route(request, replicas) must return a replica index.")

    def on_kv_events(self, replica: int, batch) -> None:
        """The KV events ``replica`` published in its last step (a KVEventBatch)."""

    def on_finished(self, replica: int, request_id: str) -> None:
        """``request_id`` finished on ``replica``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


def lowest(values: Sequence[float]) -> int:
    """The index of the smallest value, ties to the lowest index."""
    return min(range(len(values)), key=values.__getitem__)
