"""SGLang's cache-aware router: prefix affinity from an approximate radix tree, unless the load is unbalanced.

For each arrival, with ``load`` = each replica's unfinished requests:

1. the load is *unbalanced* when ``max - min > balance_abs_threshold`` and
   ``max > min * balance_rel_threshold``: the least loaded replica gets it (shortest queue);
2. otherwise, if the replica whose tree holds the longest prefix of the prompt matches more
   than ``cache_threshold`` of it, that replica gets it;
3. otherwise the replica with the smallest tree (the most room for new prefixes) gets it.

The prompt is then inserted into the tree under the chosen replica. Ties go to the lowest
index. The defaults are SGLang's router's (``cache_threshold=0.3``,
``balance_abs_threshold=64``, ``balance_rel_threshold=1.5``, ``eviction_interval_secs=120``,
``max_tree_size=2**26``); the tree is keyed by token ids, SGLang's by characters. Eviction
runs at the first arrival at least ``eviction_interval`` after the last one (in the
workload's clock units).

Scores kept per replica: ``requests`` (the load), ``match`` (the fraction of the prompt its
tree holds), ``tree_size`` (tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

from workbench.cluster.radix_tree import RadixTree
from workbench.cluster.replica import ReplicaView
from workbench.cluster.router import RoutedRequest, Router, Routing, lowest


class CacheAware(Router):
    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, eviction_interval: float = 120.0,
                 max_tree_size: int = 2**26) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold!r}.")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError(f"balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1, got "
                             f"{balance_abs_threshold!r} and {balance_rel_threshold!r}.")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold, self.balance_rel_threshold = balance_abs_threshold, balance_rel_threshold
        self.eviction_interval, self.max_tree_size = eviction_interval, max_tree_size
        self.tree = RadixTree()
        self.last_eviction = 0.0

    def route(self, request: RoutedRequest, replicas: Sequence[ReplicaView]) -> Routing:
        tokens = request.prompt_token_ids
        if request.arrival - self.last_eviction >= self.eviction_interval:
            self.tree.evict(self.max_tree_size)
            self.last_eviction = request.arrival
        load = [r.num_requests for r in replicas]
        matched = self.tree.match(tokens)
        match = [matched.get(i, 0) / len(tokens) for i in range(len(replicas))]
        sizes = [self.tree.size.get(i, 0) for i in range(len(replicas))]
        high, low = max(load), min(load)
        if high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold:
            choice = lowest(load)
        elif max(match) > self.cache_threshold:
            choice = lowest([-m for m in match])
        else:
            choice = lowest(sizes)
        self.tree.insert(tokens, choice, request.arrival)
        return Routing(choice, {"requests": load, "match": match, "tree_size": sizes})
