"""When does disaggregation pay? Goodput under TTFT/TPOT SLOs, colocated vs xPyD, by simulation.

DistServe's question, asked of simulated replicas (the shipped cost model, the real scheduler
and KV cache, the in-process connector's modelled link): for one workload, each layout of
the same number of replicas -- ``colocated`` (``least_requests``) or ``xPyD`` (``pd_proxy``)
-- and each link speed, the SLO attainment (the share of requests whose TTFT and TPOT both
meet their SLO) and the goodput (requests meeting both, per second of the run: from the
first arrival to the last finish). A colocated layout moves no KV, so it runs once per workload.

``layouts(n)`` names the layouts of ``n`` replicas (``colocated``, then every ``xPyD`` with
``x + y == n``); ``MIXES`` are two synthetic extremes (prefill-heavy: long prompts, short
answers; decode-heavy: the reverse) and a shipped trace's mix; ``sweep(...)`` is the table,
``crossover(table)`` the slowest link at which each xPyD layout beats colocated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from workbench.cluster.cluster import Cluster
from workbench.lab.workload import Workload

#: The replica config of the study: 16-token blocks, room for long prompts.
CONFIG = {"block_size": 16, "num_kv_blocks": 1024, "max_num_seqs": 32, "max_num_batched_tokens": 1024}

#: Workload mixes: Poisson arrivals with these prompt/output lengths, or a shipped trace.
MIXES = {
    "prefill-heavy": {"input_len": (600, 900), "output_len": (8, 24)},
    "decode-heavy": {"input_len": (32, 96), "output_len": (96, 160)},
    "azure-conv": {"trace": "azure_conv"},
}
#: A rate (requests/s) per mix that loads three simulated replicas of :data:`CONFIG`.
RATES = {"prefill-heavy": 45.0, "decode-heavy": 60.0, "azure-conv": 30.0}


def layouts(num_replicas: int) -> dict[str, tuple[int, int] | None]:
    """{name: (prefill, decode) or None for colocated} for ``num_replicas`` replicas."""
    if not isinstance(num_replicas, int) or num_replicas < 2:
        raise ValueError(f"num_replicas must be an integer >= 2 (a prefill and a decode replica), got {num_replicas!r}.")
    out: dict[str, tuple[int, int] | None] = {"colocated": None}
    for x in range(num_replicas - 1, 0, -1):
        out[f"{x}P{num_replicas - x}D"] = (x, num_replicas - x)
    return out


def workload(mix: str, num_requests: int, rate: float, seed: int = 0) -> Workload:
    """The ``mix`` (a key of :data:`MIXES`) at ``rate`` requests per second."""
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {sorted(MIXES)}, got {mix!r}.")
    spec = MIXES[mix]
    if "trace" in spec:
        return Workload.from_trace(spec["trace"], max_requests=num_requests, rate=rate, seed=seed)
    return Workload.poisson(num_requests, rate=rate, seed=seed, clock="wall", **spec)


def slo_attainment(result, ttft_slo: float, tpot_slo: float) -> dict[str, float]:
    """``attainment`` (share of requests meeting both SLOs), ``goodput`` (those per second from
    the first arrival to the last finish), and the TTFT/TPOT p50 and p99 (seconds)."""
    frame = result.requests
    ok = (frame["ttft_s"] <= ttft_slo) & (frame["tpot_s"].fillna(0.0) <= tpot_slo)
    arrivals = [r.arrival_time or 0.0 for r in result.workload]
    span = max(r.end_s for r in result.replicas) - min(arrivals)
    s = result.summary()
    return {"attainment": float(ok.mean()) if len(frame) else math.nan,
            "goodput": float(ok.sum()) / span if span > 0 else math.nan,
            **{k: s[k] for k in ("ttft_s_p50", "ttft_s_p99", "tpot_s_p50", "tpot_s_p99")}}


def sweep(mixes: Sequence[str], num_replicas: int, link_gbps: Sequence[float], *, rate: float | None = None,
          num_requests: int, ttft_slo: float, tpot_slo: float, config: dict | None = None,
          cost_model=None, seed: int = 0) -> pd.DataFrame:
    """One row per (mix, layout, link): the layout's SLO attainment and goodput (colocated:
    one row per mix, ``link_gbps`` NaN). ``rate``: requests/s (default: the mix's :data:`RATES`)."""
    config = {**CONFIG, **(config or {})}
    rows = []
    for mix in mixes:
        wl = workload(mix, num_requests, rate or RATES[mix], seed)
        for name, pools in layouts(num_replicas).items():
            for gbps in ([math.nan] if pools is None else link_gbps):
                if pools is None:
                    cluster = Cluster.simulated(num_replicas, config, router="least_requests", cost_model=cost_model)
                else:
                    cluster = Cluster.simulated(config=config, prefill=pools[0], decode=pools[1], router="pd_proxy",
                                                cost_model=cost_model, link={"link_bandwidth_gbps": gbps})
                result = cluster.run(wl)
                rows.append({"mix": mix, "layout": name, "link_gbps": gbps,
                             **slo_attainment(result, ttft_slo, tpot_slo)})
    return pd.DataFrame(rows)


def crossover(table: pd.DataFrame) -> pd.DataFrame:
    """Per (mix, xPyD layout): colocated's goodput, the layout's best goodput, and the slowest
    link at which it beats colocated (NaN: at none of the links swept)."""
    rows = []
    for mix, group in table.groupby("mix", sort=False):
        base = float(group.loc[group["layout"] == "colocated", "goodput"].iloc[0])
        for layout, runs in group[group["layout"] != "colocated"].groupby("layout", sort=False):
            better = runs[runs["goodput"] > base]
            rows.append({"mix": mix, "layout": layout, "colocated_goodput": base,
                         "best_goodput": float(runs["goodput"].max()),
                         "slowest_winning_link_gbps": float(better["link_gbps"].min()) if len(better) else math.nan})
    return pd.DataFrame(rows)
