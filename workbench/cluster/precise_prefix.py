"""Precise prefix routing (llm-d's precise-prefix-cache scorer): prefix hits read from KV events.

As :class:`~workbench.cluster.scorers.WeightedScorers` (queue, KV-cache utilisation, prefix;
weights ``2, 2, 3``; max-score picker, seeded random ties), but the ``prefix`` score of a
replica is the fraction of the prompt's full blocks its prefix cache *holds now*: the prompt
is hashed with the engine's own chained block hash (:mod:`workbench.core.kv_cache_utils`, the
request's LoRA adapter included) and looked up in a :class:`~workbench.cluster.kv_index.KVBlockIndex`
built from the replicas' KV events (vLLM's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``), which the cluster hands it after every step. Nothing is guessed from the
routing history: an evicted block stops counting when its ``BlockRemoved`` arrives.
"""

from __future__ import annotations

from collections.abc import Sequence

from workbench.cluster.kv_index import KVBlockIndex
from workbench.cluster.replica import ReplicaView
from workbench.cluster.router import RoutedRequest
from workbench.cluster.scorers import WeightedScorers
from workbench.core.kv_cache_utils import hash_request_blocks


class PrecisePrefix(WeightedScorers):
    name = "precise_prefix"
    reads_kv_events = True

    def __init__(self, weights: dict[str, float] | None = None, *, max_prefix_blocks: int = 256,
                 seed: int = 0) -> None:
        super().__init__(weights, max_prefix_blocks=max_prefix_blocks, seed=seed)
        self.index = KVBlockIndex()

    def on_kv_events(self, replica: int, batch) -> None:
        self.index.apply(replica, batch)

    def prefix_scores(self, request: RoutedRequest, replicas: Sequence[ReplicaView]) -> list[float]:
        tokens = request.prompt_token_ids
        lora = request.request.lora_request
        hashes_by_size: dict[int, list] = {}
        scores = []
        for r in replicas:
            hashes = hashes_by_size.get(r.block_size)
            if hashes is None:
                usable = tokens[:r.block_size * self.max_prefix_blocks]
                hashes = hashes_by_size[r.block_size] = hash_request_blocks(
                    usable, r.block_size, lora_name=lora.lora_name if lora is not None else None)
            scores.append(self.index.leading_blocks(r.index, hashes) / len(hashes) if hashes else 0.0)
        return scores

    def chosen(self, request: RoutedRequest, replica: ReplicaView) -> None:
        """Nothing to guess: the chosen replica's events will say what it cached."""
