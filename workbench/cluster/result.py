"""ClusterResult: what a cluster run recorded -- every request, every routing decision, each replica.

* ``requests``: one row per request (the columns of
  :mod:`workbench.metrics.request_tracker`), with the ``replica`` that served it; times are
  seconds on that replica's clock, which starts at 0 with the workload's first arrival.
* ``decisions``: one row per arrival in arrival order: ``arrival``, ``request_id``,
  ``router_choice`` (what the router said), ``replica`` (where the request went: the same
  unless a fork forced another), and each score the router compared, ``{name}_{replica}``.
* ``replicas``: one :class:`ReplicaRun` per replica (its StepHistory, its requests, its
  prefix-cache counts); ``per_replica()`` tabulates them.
* ``summary()``: the cluster's numbers (see its docstring).
* ``fork(request_id, replica)``: the same run with that one request sent to ``replica`` (every
  other arrival still asks the router); ``regret(sample=K)``: for K sampled decisions, each
  alternative replica's fork and the latency difference it made -- the outcome, not the
  router's score. Both need a run that repeats itself: simulated replicas, or real ones on
  the step clock.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from workbench.config import EngineConfig
from workbench.engine.history import StepHistory

PERCENTILES = (50, 99)


@dataclass
class ReplicaRun:
    """One replica's share of a cluster run. ``end_s``: its clock at the end (busy time plus
    the idle jumps); ``prefix_queries`` / ``prefix_hits``: prompt tokens looked up in its
    prefix cache at admissions and found there."""

    index: int
    config: EngineConfig
    history: StepHistory
    requests: pd.DataFrame
    num_steps: int
    end_s: float
    prefix_queries: int
    prefix_hits: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass
class ClusterResult:
    """A cluster run (see the module docstring)."""

    cluster: object  # the Cluster that ran it (fork and regret run it again)
    workload: object
    clock: str
    router: str
    replicas: list[ReplicaRun]
    decision_rows: list[dict] = field(repr=False)
    outputs: dict = field(default_factory=dict, repr=False)
    rejected: dict[str, str] = field(default_factory=dict)
    forced: dict[str, int] = field(default_factory=dict)
    simulated: bool = False

    @property
    def requests(self) -> pd.DataFrame:
        frames = [r.requests.assign(replica=r.index) for r in self.replicas if len(r.requests)]
        if not frames:
            return pd.DataFrame(columns=["request_id", "replica"])
        order = {rid: i for i, rid in enumerate(d["request_id"] for d in self.decision_rows)}
        frame = pd.concat(frames, ignore_index=True)
        return frame.sort_values("request_id", key=lambda s: s.map(order)).reset_index(drop=True)

    @property
    def decisions(self) -> pd.DataFrame:
        return pd.DataFrame(self.decision_rows)

    def per_replica(self) -> pd.DataFrame:
        """One row per replica: requests served, steps, busy-until seconds, prefix hit rate,
        TTFT and TPOT percentiles."""
        rows = []
        for r in self.replicas:
            row = {"replica": r.index, "requests": len(r.requests), "steps": r.num_steps, "end_s": r.end_s,
                   "prefix_hit_rate": r.prefix_hit_rate}
            row.update(_latencies(r.requests, self.clock))
            rows.append(row)
        return pd.DataFrame(rows)

    def summary(self, slo: dict[str, float] | None = None) -> dict[str, float]:
        """``num_requests``, ``num_finished``, ``ttft`` / ``tpot`` / ``e2e`` p50 and p99 over every
        request (``*_s`` on the wall clock, ``*_steps`` on the step clock), ``prefix_hit_rate``
        (hit / looked-up prompt tokens, all replicas), ``load_i`` (requests routed to replica i),
        ``imbalance`` (the most requests on a replica over the mean), ``makespan`` (the latest
        replica clock at the end) and ``rejected``. With ``slo`` (e.g. ``{"ttft_s_p99": 0.5}``):
        ``slo_met`` (this run meets it) and ``goodput``, the highest arrival rate at which this
        cluster meets it on this workload (rescaled; a search of several runs, see
        :func:`~workbench.cluster.capacity.cluster_capacity`, headroom 0)."""
        frame = self.requests
        loads = [len(r.requests) for r in self.replicas]
        queries = sum(r.prefix_queries for r in self.replicas)
        out: dict[str, float] = {"num_requests": len(frame),
                                 "num_finished": int(frame["finish_reason"].notna().sum()) if len(frame) else 0}
        out.update(_latencies(frame, self.clock))
        out["prefix_hit_rate"] = sum(r.prefix_hits for r in self.replicas) / queries if queries else 0.0
        for i, n in enumerate(loads):
            out[f"load_{i}"] = n
        mean = sum(loads) / len(loads)
        out["imbalance"] = max(loads) / mean if mean else math.nan
        out["makespan"] = max(r.num_steps if self.clock == "steps" else r.end_s for r in self.replicas)
        out["rejected"] = len(self.rejected)
        if slo is not None:
            from workbench.cluster.capacity import cluster_capacity
            from workbench.lab.capacity import check_slo, slo_holds

            out["slo_met"] = slo_holds(out, check_slo(slo))
            out["goodput"] = cluster_capacity(self.cluster, self.workload, slo, headroom=0.0).rate
        return out

    # ------------------------------------------------------------ what if
    def fork(self, request_id: str, replica: int) -> ClusterResult:
        """This run again with ``request_id`` routed to ``replica`` (and the earlier forks' choices
        kept): the arrivals before it repeat exactly, the later ones are routed by a fresh copy of
        the router on the changed state."""
        if not self.simulated and self.clock != "steps":
            raise ValueError("fork: real replicas on the wall clock do not repeat a run (their step times are "
                             "measured anew); fork a simulated cluster, or run the workload on the step clock.")
        if request_id not in {d["request_id"] for d in self.decision_rows}:
            raise ValueError(f"fork: request {request_id!r} was not routed in this run.")
        if not (isinstance(replica, int) and 0 <= replica < len(self.replicas)):
            raise ValueError(f"fork: replica must be an integer in [0, {len(self.replicas) - 1}], got {replica!r}.")
        return self.cluster.run(self.workload, forced={**self.forced, request_id: replica})

    def regret(self, sample: int = 8, seed: int = 0, request_ids: list[str] | None = None) -> pd.DataFrame:
        """For ``sample`` decisions drawn from ``seed`` (all when there are fewer; or the
        decisions of ``request_ids``, when given), every
        alternative replica's :meth:`fork`: one row per (decision, alternative) with the
        request's ``ttft_delta`` and ``e2e_delta`` (fork minus this run; negative: the
        alternative was better for it) and ``mean_e2e_delta`` over every request (what the
        choice cost the cluster). Latencies in seconds, or steps on the step clock."""
        if not isinstance(sample, int) or isinstance(sample, bool) or sample < 1:
            raise ValueError(f"sample must be an integer >= 1, got {sample!r}.")
        unit = "steps" if self.clock == "steps" else "s"
        ttft, e2e = f"ttft_{unit}", f"e2e_{unit}"
        base = self.requests.set_index("request_id")
        if request_ids is not None:
            where = {d["request_id"]: i for i, d in enumerate(self.decision_rows)}
            missing = [rid for rid in request_ids if rid not in where]
            if missing:
                raise ValueError(f"regret: request(s) {missing} were not routed in this run.")
            picked = np.array([where[rid] for rid in request_ids], dtype=int)
        else:
            picked = np.random.default_rng(seed).choice(len(self.decision_rows),
                                                       min(sample, len(self.decision_rows)), replace=False)
        rows = []
        for i in sorted(picked.tolist()):
            d = self.decision_rows[i]
            rid = d["request_id"]
            if rid in self.rejected:
                continue
            for alternative in range(len(self.replicas)):
                if alternative == d["replica"]:
                    continue
                fork = self.fork(rid, alternative).requests.set_index("request_id")
                rows.append({"arrival": d["arrival"], "request_id": rid, "replica": d["replica"],
                             "alternative": alternative,
                             "ttft_delta": float(fork.loc[rid, ttft] - base.loc[rid, ttft]),
                             "e2e_delta": float(fork.loc[rid, e2e] - base.loc[rid, e2e]),
                             "mean_e2e_delta": float(fork[e2e].mean() - base[e2e].mean())})
        return pd.DataFrame(rows, columns=["arrival", "request_id", "replica", "alternative", "ttft_delta",
                                           "e2e_delta", "mean_e2e_delta"])

    def __repr__(self) -> str:
        s = self.summary()
        unit = "steps" if self.clock == "steps" else "s"
        loads = [s[f"load_{i}"] for i in range(len(self.replicas))]
        return (f"ClusterResult({s['num_requests']} requests on {len(self.replicas)} "
                f"{'simulated ' if self.simulated else ''}replicas, router={self.router}, loads={loads}, "
                f"prefix_hit_rate={s['prefix_hit_rate']:.3f}, ttft_{unit}_p50={s[f'ttft_{unit}_p50']:.4g}, "
                f"imbalance={s['imbalance']:.3f})")

    def _repr_html_(self) -> str:
        return (f"<div><b>ClusterResult</b>: {html.escape(repr(self))}"
                + self.per_replica().to_html(index=False, float_format=lambda v: f"{v:.4g}") + "</div>")


def _latencies(frame: pd.DataFrame, clock: str) -> dict[str, float]:
    unit = "steps" if clock == "steps" else "s"
    out = {}
    for metric in ("ttft", "tpot", "e2e"):
        column = f"{metric}_{unit}"
        values = frame[column].astype("float64").dropna() if len(frame) else pd.Series(dtype="float64")
        for p in PERCENTILES:
            out[f"{column}_p{p}"] = float(values.quantile(p / 100)) if len(values) else math.nan
    return out
