"""The load-balancing routers: round robin, least requests, power of two choices, session affinity.

Ties always go to the lowest replica index, so every assignment can be worked out by hand.

* ``round_robin``: replicas in turn, 0, 1, ..., n - 1, 0, ...
* ``least_requests``: the replica holding the fewest unfinished requests (vLLM production
  stack's and SGLang's shortest queue).
* ``power_of_two``: two distinct replicas drawn from a seeded generator
  (``random.Random(seed).sample``), the one with fewer unfinished requests; a tie goes to the
  first drawn (as SGLang's ``power_of_two``).
* ``session``: affinity by a key (``key(request)``, default the workload request's
  ``session_id`` attribute if it has one): the first request of a key goes to the replica
  with the fewest unfinished requests, and every later one of that key to the same replica;
  a request without a key is routed as ``least_requests``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from workbench.cluster.cache_aware import CacheAware
from workbench.cluster.pd import PDProxy
from workbench.cluster.precise_prefix import PrecisePrefix
from workbench.cluster.replica import ReplicaView
from workbench.cluster.router import RoutedRequest, Router, Routing, lowest
from workbench.cluster.scorers import WeightedScorers


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self) -> None:
        self.next = 0

    def route(self, request: RoutedRequest, replicas: Sequence[ReplicaView]) -> Routing:
        choice = self.next % len(replicas)
        self.next = choice + 1
        return Routing(choice, {"requests": [r.num_requests for r in replicas]})


class LeastRequests(Router):
    name = "least_requests"

    def route(self, request: RoutedRequest, replicas: Sequence[ReplicaView]) -> Routing:
        load = [r.num_requests for r in replicas]
        return Routing(lowest(load), {"requests": load})


class PowerOfTwo(Router):
    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.rng = random.Random(seed)

    def route(self, request: RoutedRequest, replicas: Sequence[ReplicaView]) -> Routing:
        load = [r.num_requests for r in replicas]
        if len(replicas) == 1:
            return Routing(0, {"requests": load})
        a, b = self.rng.sample(range(len(replicas)), 2)
        drawn = [1.0 if i in (a, b) else 0.0 for i in range(len(replicas))]
        return Routing(a if load[a] <= load[b] else b, {"requests": load, "drawn": drawn})


def _session_id(request: RoutedRequest):
    return getattr(request.request, "session_id", None)


class Session(Router):
    name = "session"

    def __init__(self, key: Callable[[RoutedRequest], object] | None = None) -> None:
        self.key = key or _session_id
        self.assigned: dict[object, int] = {}

    def route(self, request: RoutedRequest, replicas: Sequence[ReplicaView]) -> Routing:
        load = [r.num_requests for r in replicas]
        key = self.key(request)
        sticky = [0.0] * len(replicas)
        if key is None:
            return Routing(lowest(load), {"requests": load, "sticky": sticky})
        if key in self.assigned:
            choice = self.assigned[key]
            sticky[choice] = 1.0
        else:
            choice = self.assigned[key] = lowest(load)
        return Routing(choice, {"requests": load, "sticky": sticky})


#: Router names ``Cluster(router=...)`` accepts, and what each builds (with default arguments).
ROUTERS = {
    "round_robin": RoundRobin,
    "least_requests": LeastRequests,
    "power_of_two": PowerOfTwo,
    "session": Session,
    "cache_aware": CacheAware,
    "llm_d": WeightedScorers,
    "precise_prefix": PrecisePrefix,
    "pd_proxy": PDProxy,
}


def resolve_router(router: str | Router) -> Router:
    """A Router from one or from its name; ValueError naming the known ones otherwise."""
    if isinstance(router, Router):
        return router
    if isinstance(router, str) and router in ROUTERS:
        return ROUTERS[router]()
    raise ValueError(f"router must be a Router or one of {sorted(ROUTERS)}, got {router!r}.")
