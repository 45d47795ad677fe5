"""Cluster: N engines behind a router, each on its own clock, driven through a workload.

``Cluster(replicas=[EngineArgs(...), ...], router="cache_aware")`` builds real engines;
``Cluster.simulated(n, config, cost_model=..., router=...)`` builds engines on the real
scheduler and KV cache with a :class:`~workbench.lab.sim.simulated_runner.SimulatedRunner`.
``cluster.run(workload)`` builds fresh engines and a fresh copy of the router every time, so
a run can be repeated (and forked: :meth:`ClusterResult.fork`).

The run is a discrete-event loop over the replicas' clocks (see :mod:`workbench.cluster.replica`):
the next thing to happen is either the next arrival, at ``a``, or a step of the busy replica
whose clock is the earliest, at ``t``. The step runs first when ``t < a``; otherwise the
arrival is routed: the router sees every replica as it was after its last step, and the
request is added to the chosen one with arrival time ``a`` (an idle replica's clock jumps to
``a``; a busy one takes it at its next step boundary, as one engine does under
:func:`~workbench.lab.replay.drive`). Ties between replicas go to the lowest index.

On the step clock (``workload.clock == "steps"``) a replica's time is its step count and,
as :func:`~workbench.lab.replay.drive` does for one engine, an idle replica keeps
stepping while arrivals are still to come; so a 1-replica cluster repeats the plain engine's
run step for step on either clock.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Callable, Sequence

from workbench.cluster.pd import PDLegs, PDRouting, pd_configs
from workbench.cluster.replica import MeasuredClock, Replica
from workbench.cluster.result import ClusterResult, ReplicaRun
from workbench.cluster.router import RoutedRequest, Router, Routing
from workbench.cluster.routers import resolve_router
from workbench.config import EngineConfig
from workbench.core.kv_event_batch import to_kv_event_batch
from workbench.engine.llm_engine import LLMEngine
from workbench.lab.corpus_prompts import encode
from workbench.lab.run import resolve_config
from workbench.lab.sim.cost_model import CostModel, as_cost_model
from workbench.lab.sim.simulate import lean_requests, output_lengths, simulated_engine
from workbench.lab.workload import LengthSpec, Workload
from workbench.metrics.request_tracker import RequestTracker
from workbench.utils.heap import frozen_heap, rare_collections


class Cluster:
    """Replicas (real engines from EngineArgs, or simulated ones) behind ``router`` (a name
    of :data:`~workbench.cluster.routers.ROUTERS` or a :class:`Router`)."""

    def __init__(self, replicas: Sequence[EngineConfig | dict] | None = None, router: str | Router = "round_robin",
                 *, prefill: Sequence | None = None, decode: Sequence | None = None, link: dict | None = None) -> None:
        """``prefill`` / ``decode`` (instead of ``replicas``): a P/D cluster over ``link``
        (see :mod:`workbench.cluster.pd`), normally behind ``router="pd_proxy"``."""
        if prefill is not None or decode is not None:
            if replicas is not None:
                raise ValueError("give either replicas or prefill and decode, not both.")
            replicas = pd_configs(prefill or (), decode or (), link)
        if isinstance(replicas, (str, bytes)) or not isinstance(replicas, Sequence) or not replicas:
            raise ValueError(f"replicas must be a non-empty list of EngineArgs (or dicts of overrides), got {replicas!r}.")
        self.configs = tuple(resolve_config(c) for c in replicas)
        self.router = resolve_router(router)
        self.cost_model: CostModel | None = None
        self.output_len: LengthSpec | None = None
        self.seed = 0

    @classmethod
    def simulated(cls, n: int | None = None, config: EngineConfig | dict | None = None, *, cost_model: CostModel | str | None = None,
                  router: str | Router = "round_robin", output_len: LengthSpec | None = None,
                  seed: int = 0, prefill: int | None = None, decode: int | None = None,
                  link: dict | None = None) -> Cluster:
        """``n`` simulated replicas of ``config``, timed by ``cost_model`` (a CostModel, its JSON
        path, or None: the shipped calibration). Requests without ``ignore_eos`` draw their
        output lengths from ``output_len`` and ``seed``, as :func:`~workbench.lab.sim.simulate`."""
        if prefill is not None or decode is not None:  # xPyD: n is their sum
            cluster = cls(router=router, prefill=[resolve_config(config)] * (prefill or 0),
                          decode=[resolve_config(config)] * (decode or 0), link=link)
        elif not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be an integer >= 1 (the number of replicas), got {n!r}.")
        else:
            cluster = cls([resolve_config(config)] * n, router)
        cluster.cost_model, cluster.output_len, cluster.seed = as_cost_model(cost_model), output_len, seed
        return cluster

    @property
    def simulated_replicas(self) -> bool:
        return self.cost_model is not None

    def __len__(self) -> int:
        return len(self.configs)

    def __repr__(self) -> str:
        kind = "simulated" if self.simulated_replicas else "real"
        return f"Cluster({len(self)} {kind} replicas, router={self.router.name})"

    def with_router(self, router: str | Router) -> Cluster:
        """The same replicas behind another router."""
        other = copy.copy(self)
        other.router = resolve_router(router)
        return other

    # ------------------------------------------------------------ running
    def run(self, workload: Workload, *, forced: dict[str, int] | None = None) -> ClusterResult:
        """Route and run every request of ``workload`` (on its own clock) until all finished.
        ``forced`` {request id: replica}: those requests go there whatever the router says
        (the router is still asked, and its scores kept): how :meth:`ClusterResult.fork` replays
        another choice."""
        if not isinstance(workload, Workload):
            workload = Workload(workload)
        forced = dict(forced or {})
        for rid, index in forced.items():
            if not (isinstance(index, int) and 0 <= index < len(self)):
                raise ValueError(f"forced: request {rid!r} names replica {index!r}; replicas are 0..{len(self) - 1}.")
        run = _Run(self, workload, forced)
        with rare_collections(), frozen_heap() as refreeze:
            run.loop(refreeze)
        return run.result()

    def _replica(self, index: int, lengths: dict[str, int], max_requests: int) -> Replica:
        config = self.configs[index]
        if self.simulated_replicas:
            engine = simulated_engine(config, self.cost_model, lengths)
            replica = Replica(index, engine, engine.clock, measured=False)
        else:
            clock = MeasuredClock()
            replica = Replica(index, LLMEngine(config, clock=clock), clock, measured=True)
        replica.engine.request_tracker = RequestTracker(epoch=0.0, max_requests=max_requests)
        return replica


class _Run:
    """One run of a cluster: the replicas, the router's copy, the arrivals still to come."""

    def __init__(self, cluster: Cluster, workload: Workload, forced: dict[str, int]) -> None:
        self.cluster, self.workload, self.forced = cluster, workload, forced
        self.clock = workload.clock
        if cluster.simulated_replicas:
            lengths = output_lengths(workload, cluster.output_len, cluster.seed)
            driven = lean_requests(workload)
        else:
            lengths, driven = {}, list(workload)
        field = "arrival_step" if self.clock == "steps" else "arrival_time"
        self.pending = deque(sorted(driven, key=lambda r: getattr(r, field) or 0))  # stable: ties keep order
        self.field = field
        max_requests = max(100_000, len(workload))
        self.replicas = [cluster._replica(i, lengths, max_requests) for i in range(len(cluster))]
        for replica in self.replicas:
            replica.on_step_clock = self.clock == "steps"
        self.router = copy.deepcopy(cluster.router)
        #: Prefill/decode legs (a P/D cluster: workbench.cluster.pd), else None.
        self.pd = PDLegs() if any(c.kv_transfer_config for c in cluster.configs) else None
        if self.pd is not None and self.clock == "steps":
            raise ValueError("a P/D cluster runs on the wall clock (a transfer takes seconds): give the workload "
                             "arrival_time, not arrival_step.")
        self.tokenizer = self.replicas[0].engine.tokenizer
        self.decisions: list[dict] = []
        self.outputs: dict[str, object] = {}
        self.rejected: dict[str, str] = {}
        self.busy = [r.busy for r in self.replicas]  # kept by _step and _add: the loop reads it
        self._columns: dict[str, list[str]] = {}  # score name -> its decision columns
        if self.router.reads_kv_events:
            for replica in self.replicas:
                replica.engine.on_step.append(self._kv_hook(replica.index))

    def _kv_hook(self, index: int):
        router = self.router

        def publish(record) -> None:
            batch = to_kv_event_batch(record.kv_events, ts=self.replicas[index].clock())
            if batch.events:
                router.on_kv_events(index, batch)
        return publish

    def loop(self, between_steps: Callable[[], None] = lambda: None) -> None:
        """Route arrivals and step replicas in time order until all is done;
        ``between_steps`` is called before each step (``frozen_heap``'s refreeze)."""
        steps = self.clock == "steps"
        pending, replicas, busy, field = self.pending, self.replicas, self.busy, self.field
        while True:
            arrival = (getattr(pending[0], field) or 0) if pending else math.inf
            handoff = self.pd.next_handoff() if self.pd is not None else math.inf  # a decode leg's
            if handoff <= arrival and handoff < math.inf:
                arrival = handoff
            nxt, first = None, math.inf
            for replica in replicas:
                now = replica.now
                if now < first and (busy[replica.index] or (steps and pending and now < arrival)):
                    nxt, first = replica, now
            if first < arrival:
                between_steps()
                self._step(nxt)
            elif handoff == arrival and handoff < math.inf:
                self.pd.deliver(self)
            elif pending:
                self._route(pending.popleft(), arrival)
            else:
                break

    def _step(self, replica: Replica) -> None:
        for out in replica.step():
            if out.finished and not (self.pd is not None and self.pd.on_finished(self, replica, out)):
                self.outputs[out.request_id] = out
                self.router.on_finished(replica.index, out.request_id)
        # With P/D a step also changes its peers: a decode replica's read frees a producer's blocks.
        for changed in (self.replicas if self.pd is not None else (replica,)):
            self.busy[changed.index] = changed.busy

    def _route(self, request, arrival: float) -> None:
        rid = request.request_id
        routed = RoutedRequest(rid, request, arrival, self._encode)
        views = [r.view() for r in self.replicas]
        answer = self.router.route(routed, views)
        routing = answer if isinstance(answer, Routing) else Routing(answer)
        choice = routing.replica
        if not (isinstance(choice, int) and 0 <= choice < len(self.replicas)):
            raise ValueError(f"router {self.router.name!r} chose replica {choice!r} for request {rid!r}; "
                             f"replicas are 0..{len(self.replicas) - 1}.")
        chosen = self.forced.get(rid, choice)
        row = {"arrival": arrival, "request_id": rid, "router_choice": choice, "replica": chosen}
        for name, values in routing.scores.items():
            if len(values) != len(self.replicas):
                raise ValueError(f"router {self.router.name!r}: score {name!r} has {len(values)} values for "
                                 f"{len(self.replicas)} replicas.")
            columns = self._columns.get(name)
            if columns is None:
                columns = self._columns[name] = [f"{name}_{i}" for i in range(len(self.replicas))]
            for column, v in zip(columns, values):
                row[column] = float(v)
        self.decisions.append(row)
        if isinstance(routing, PDRouting) and routing.decode is not None and self.pd is not None:
            row["decode_replica"] = routing.decode
            self.pd.start(self, request, arrival, chosen, routing.decode)
            return
        self._add(self.replicas[chosen], request, arrival)

    def _encode(self, text: str) -> list[int]:
        return encode(self.tokenizer, text)

    def _add(self, replica: Replica, request, arrival: float) -> None:
        engine = replica.engine
        wall = self.clock == "wall"
        if wall:
            replica.idle_until(arrival)
        try:
            engine.add_request(
                request.request_id,
                request.prompt if isinstance(request.prompt, str) else list(request.prompt),
                request.params,
                priority=request.priority if engine.uses_priority else 0,
                arrival_time=arrival if wall else None,
                lora_request=request.lora_request,
            )
            processed = getattr(replica.clock, "input_processed", None)
            if processed is not None and isinstance(request.prompt, str):
                processed(len(engine.output_processor.parents[request.request_id].prompt_token_ids))
        except ValueError as e:
            self.rejected[request.request_id] = str(e)
        replica.changed()
        self.busy[replica.index] = replica.busy

    def result(self) -> ClusterResult:
        runs = []
        for replica in self.replicas:
            engine, stats = replica.engine, replica.engine.kv_cache.prefix_cache_stats
            runs.append(ReplicaRun(
                index=replica.index, config=engine.config, history=engine.history,
                requests=(self.pd.final_rows(replica.index, engine.request_tracker.dataframe()) if self.pd
                          else engine.request_tracker.dataframe()), num_steps=replica.steps, end_s=replica.now,
                prefix_queries=stats.queries - replica.prefix0[0], prefix_hits=stats.hits - replica.prefix0[1]))
        return ClusterResult(
            cluster=self.cluster, workload=self.workload, clock=self.clock, router=self.router.name,
            replicas=runs, decision_rows=self.decisions, outputs=self.outputs, rejected=self.rejected,
            forced=self.forced, simulated=self.cluster.simulated_replicas)
