"""llm-d's inference scheduler: weighted scorers and a max-score picker.

Each scorer gives every replica a score in [0, 1]; the router picks the replica with the
largest weighted sum. Ties are broken at random, as llm-d's max-score picker does, from a
seeded generator: ``random.Random(seed).choice(tied)`` over the tied indices in order, drawn
only when there is a tie. The scorers, as llm-d's (Gateway API Inference Extension) plugins:

* ``queue``: ``(max_q - q) / (max_q - min_q)`` over the replicas' waiting queues, 1 for all
  when they are equal;
* ``kv_cache``: ``1 - kv_usage`` (the KV-cache utilisation scorer);
* ``prefix``: the approximate prefix-cache scorer: the prompt hashed in blocks of the
  replica's block size (at most ``max_prefix_blocks``), score = leading blocks found in the
  replica's LRU of block hashes (``lru_capacity`` per replica) / the prompt's blocks; the
  chosen replica's LRU then records the prompt's blocks.

Default weights: llm-d's default scheduling profile (``queue 2, kv_cache 2, prefix 3``).
:class:`~workbench.cluster.precise_prefix.PrecisePrefix` swaps the approximate prefix
scorer for one fed by the replicas' KV events.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from workbench.cluster.replica import ReplicaView
from workbench.cluster.router import RoutedRequest, Router, Routing

DEFAULT_WEIGHTS = {"queue": 2.0, "kv_cache": 2.0, "prefix": 3.0}


def queue_scores(replicas: Sequence[ReplicaView]) -> list[float]:
    waiting = [r.num_waiting for r in replicas]
    high, low = max(waiting), min(waiting)
    return [1.0] * len(waiting) if high == low else [(high - q) / (high - low) for q in waiting]


def kv_cache_scores(replicas: Sequence[ReplicaView]) -> list[float]:
    return [1.0 - r.kv_usage for r in replicas]


def block_keys(tokens: Sequence[int], block_size: int, max_blocks: int) -> list[int]:
    """Chained keys of the prompt's full blocks (the first ``max_blocks``): a block's key
    names its whole prefix. Python's hash of int tuples is not salted per process."""
    keys, parent = [], 0
    for start in range(0, min(len(tokens) // block_size, max_blocks) * block_size, block_size):
        parent = hash((parent, tuple(tokens[start:start + block_size])))
        keys.append(parent)
    return keys


class WeightedScorers(Router):
    name = "llm_d"

    def __init__(self, weights: dict[str, float] | None = None, *, max_prefix_blocks: int = 256,
                 lru_capacity: int = 31250, seed: int = 0) -> None:
        weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        unknown = sorted(set(weights) - set(DEFAULT_WEIGHTS))
        if unknown or not weights:
            raise ValueError(f"weights: scorers are {sorted(DEFAULT_WEIGHTS)}, got {sorted(weights)}.")
        self.weights = weights
        self.max_prefix_blocks, self.lru_capacity = max_prefix_blocks, lru_capacity
        self.lrus: dict[int, OrderedDict] = {}
        self.rng = random.Random(seed)

    def prefix_scores(self, request: RoutedRequest, replicas: Sequence[ReplicaView]) -> list[float]:
        tokens, scores = request.prompt_token_ids, []
        self._keys = {}
        for r in replicas:
            keys = self._keys.get(r.block_size)
            if keys is None:
                keys = self._keys[r.block_size] = block_keys(tokens, r.block_size, self.max_prefix_blocks)
            lru = self.lrus.get(r.index, {})
            found = 0
            while found < len(keys) and keys[found] in lru:
                found += 1
            scores.append(found / len(keys) if keys else 0.0)
        return scores

    def chosen(self, request: RoutedRequest, replica: ReplicaView) -> None:
        """Record the prompt's blocks in the chosen replica's LRU."""
        lru = self.lrus.setdefault(replica.index, OrderedDict())
        for key in self._keys.get(replica.block_size, ()):
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > self.lru_capacity:
            lru.popitem(last=False)

    def route(self, request: RoutedRequest, replicas: Sequence[ReplicaView]) -> Routing:
        scorers = {"queue": queue_scores, "kv_cache": kv_cache_scores, "prefix": self.prefix_scores}
        scores = {}
        for name, weight in self.weights.items():
            fn = scorers[name]
            scores[name] = fn(request, replicas) if name == "prefix" else fn(replicas)
        total = [sum(self.weights[n] * scores[n][i] for n in scores) for i in range(len(replicas))]
        best = max(total)
        tied = [i for i, t in enumerate(total) if t == best]
        choice = tied[0] if len(tied) == 1 else self.rng.choice(tied)
        if "prefix" in self.weights:
            self.chosen(request, replicas[choice])
        return Routing(choice, {**scores, "total": total})
