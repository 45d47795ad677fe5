"""cluster_sweep(): routers x replica counts x workloads, one simulated cluster run each, as one DataFrame.

Every combination (the workloads outermost, then the routers, the replica counts fastest) is a
``Cluster.simulated(n, config, cost_model=..., router=...)`` run on that workload; a row holds
``workload`` (its name), ``router``, ``replicas``, then the run's ``summary()`` -- or, with
``capacity=slo``, the cluster's capacity under that SLO (:func:`~workbench.cluster.capacity.cluster_capacity`:
``capacity_rate``, ``capacity_bounded``, the SLO metrics at it) -- then ``error`` (None when it
ran; a combination that raises keeps its error text and the others go on).

``executor``: any ``concurrent.futures.Executor`` runs the combinations in parallel -- a Dask
``distributed.Client(...).get_executor()`` unchanged; each task carries its workload and
sends back its row only. Without one they run here, one after another (simulated runs are
single-threaded: on two cores a pool of two halves the time at best).
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Mapping, Sequence

from workbench.lab.capacity import check_slo
from workbench.lab.workload import Workload
from workbench.utils.errors import describe


def run_combination(workload: Workload, router: str, n: int, config, cost_model,
                    slo: Mapping[str, float] | None) -> tuple[dict | None, str | None]:
    """One combination, in a worker: ``(row, None)`` or ``(None, error text)``."""
    from workbench.cluster.capacity import cluster_capacity
    from workbench.cluster.cluster import Cluster

    try:
        cluster = Cluster.simulated(n, config, cost_model=cost_model, router=router)
        if slo is None:
            return dict(cluster.run(workload).summary()), None
        found = cluster_capacity(cluster, workload, slo)
        at = found.table[found.table["rate"] == found.rate]
        return {"capacity_rate": found.rate, "capacity_bounded": found.bounded,
                **{f"{m}_at_capacity": (float(at[m].iloc[0]) if len(at) else math.nan) for m in found.slo}}, None
    except Exception as e:
        return None, describe(e)


def cluster_sweep(workloads: Workload | Mapping[str, Workload], routers: Sequence[str], replicas: Sequence[int],
                  config=None, *, cost_model=None, capacity: Mapping[str, float] | None = None,
                  executor: concurrent.futures.Executor | None = None):
    """The grid's rows as a pandas DataFrame (see the module docstring). ``workloads``: one
    Workload, or several by name."""
    import pandas as pd

    from workbench.cluster.routers import ROUTERS

    if isinstance(workloads, Workload):
        workloads = {"workload": workloads}
    if not isinstance(workloads, Mapping) or not workloads or not all(
            isinstance(w, Workload) for w in workloads.values()):
        raise ValueError("workloads must be a Workload or a non-empty dict of name -> Workload.")
    unknown = [r for r in routers if r not in ROUTERS]
    if not routers or unknown:
        raise ValueError(f"routers must be names of {sorted(ROUTERS)}, got {list(routers)!r}.")
    bad = [n for n in replicas if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1)]
    if not replicas or bad:
        raise ValueError(f"replicas must be integers >= 1, got {list(replicas)!r}.")
    slo = check_slo(capacity) if capacity is not None else None
    grid = [(name, r, n) for name in workloads for r in routers for n in replicas]
    if executor is None:
        answers = [run_combination(workloads[name], r, n, config, cost_model, slo) for name, r, n in grid]
    else:
        futures = [executor.submit(run_combination, workloads[name], r, n, config, cost_model, slo)
                   for name, r, n in grid]
        answers = []
        for future in futures:
            try:
                answers.append(future.result())
            except Exception as e:  # the executor's own failure
                answers.append((None, describe(e)))
    columns = list(dict.fromkeys(k for row, _ in answers if row for k in row))
    rows = [{"workload": name, "router": r, "replicas": n, **{k: (row or {}).get(k, math.nan) for k in columns},
             "error": error} for (name, r, n), (row, error) in zip(grid, answers)]
    return pd.DataFrame(rows, columns=["workload", "router", "replicas", *columns, "error"])
