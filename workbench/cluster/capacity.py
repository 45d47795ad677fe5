"""Capacity of a cluster: the highest rate it meets an SLO at, and the replicas a rate needs.

* :func:`cluster_capacity` is :func:`workbench.lab.capacity.capacity` with the cluster as the
  runner: the workload's arrivals rescaled to each rate tried, the whole cluster run, its
  summary held to the SLO (``{"ttft_s_p99": 0.5, ...}``, every request finished). Its rate
  with ``headroom=0`` is the cluster's *goodput* (``ClusterResult.summary(slo=...)``).
* :func:`replicas_needed`: the fewest replicas like those of a simulated ``cluster`` (its first
  replica's config, its cost model and router) that meet the SLO on ``workload`` at its own rate: 1, 2, 4, ... until it holds, then bisection
  between the last count that broke and the first that held (it assumes more replicas never
  make the SLO worse, as a queue's latencies do not).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from workbench.lab.capacity import Capacity, capacity, check_slo, slo_holds
from workbench.lab.workload import Workload


class ClusterRunner:
    """``runner(workload, config)`` for the lab's searches and sweeps: runs ``cluster`` on the
    workload (``config`` is not read: each replica has its own). Picklable with its cluster."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster

    def __call__(self, workload: Workload, config=None):
        return self.cluster.run(workload)


def cluster_capacity(cluster, workload: Workload, slo: Mapping[str, float], **search) -> Capacity:
    """The highest rate at which ``cluster`` meets ``slo`` on ``workload`` (rescaled); ``search``:
    :func:`~workbench.lab.capacity.capacity`'s options (``headroom``, ``rel_tol``, ``points``,
    ``executor``, ...)."""
    search.setdefault("progress", False)
    return capacity(workload, cluster.configs[0], slo, run=ClusterRunner(cluster), **search)


@dataclass
class ReplicasNeeded:
    """The answer of :func:`replicas_needed`: ``replicas`` (None when even ``max_replicas``
    broke the SLO) and ``table``: one row per count tried (the SLO metrics, ``holds``)."""

    replicas: int | None
    slo: dict[str, float]
    table: object  # pandas DataFrame


def replicas_needed(cluster, workload: Workload, slo: Mapping[str, float], *,
                    max_replicas: int = 64) -> ReplicasNeeded:
    """The fewest replicas like ``cluster``'s (simulated) meeting ``slo`` (see the module docstring)."""
    import pandas as pd

    if not cluster.simulated_replicas:
        raise ValueError("replicas_needed: give a simulated cluster (Cluster.simulated): the search runs many.")
    slo = check_slo(slo)
    if not (isinstance(max_replicas, int) and not isinstance(max_replicas, bool) and max_replicas >= 1):
        raise ValueError(f"max_replicas must be an integer >= 1, got {max_replicas!r}.")
    tried: dict[int, dict] = {}

    def holds(n: int) -> bool:
        if n not in tried:
            tried[n] = type(cluster).simulated(n, cluster.configs[0], cost_model=cluster.cost_model,
                                               router=cluster.router, output_len=cluster.output_len,
                                               seed=cluster.seed).run(workload).summary()
        return slo_holds(tried[n], slo)

    low, high = 0, None  # low: the most replicas known to break; high: the fewest known to hold
    n = 1
    while n <= max_replicas:
        if holds(n):
            high = n
            break
        low, n = n, n * 2
    if high is None and low < max_replicas and holds(max_replicas):
        high = max_replicas
    while high is not None and high - low > 1:
        mid = (low + high) // 2
        if holds(mid):
            high = mid
        else:
            low = mid
    rows = [{"replicas": k, **{m: s.get(m, math.nan) for m in slo}, "holds": slo_holds(s, slo),
             "num_finished": s["num_finished"]} for k, s in sorted(tried.items())]
    return ReplicasNeeded(high, slo, pd.DataFrame(rows))
