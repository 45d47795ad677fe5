"""RunResult and drive(): an engine driven through a workload's arrivals, and what the run recorded.

:func:`replay_workload` drives an existing engine; :func:`workbench.lab.run.run_real`
a fresh one built from a config. A workload is any sized iterable of requests that carry what
:class:`ArrivingRequest` names (a :class:`workbench.lab.workload.Workload` of WorkloadRequests):
this module adds them at their arrival and steps, it knows nothing else of them.

Two clocks decide when a request arrives; a run is on its workload's clock (``workload.clock``,
see :mod:`workbench.lab.workload`; a plain list of requests: the step clock), and asking for
the other one is a ValueError that says how to get it:

* ``clock="steps"`` (deterministic): before engine step ``k`` of the run (counted
  from 0) every request with ``arrival_step <= k`` is added. The engine steps even when it
  has nothing to do until the next arrival, so the same workload and config always give the
  same schedule -- step numbers, batches, preemptions, block tables.
* ``clock="wall"``: a request is added at the first step boundary after ``arrival_time``
  seconds from the start, with that arrival time (so queue time counts the wait for the
  boundary); an idle engine sleeps until the next arrival.

Seconds are those of the engine's ``clock``: wall seconds, or simulated ones for an engine on
a simulated clock (:func:`workbench.lab.sim.simulate`), whose idle waits jump.

A request the engine refuses (too long for the pool, ...) is left out and reported in
``RunResult.rejected``; the rest of the run goes on.
"""

from __future__ import annotations

import dataclasses
import html
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Sized
from dataclasses import dataclass, field
from typing import Protocol

from workbench.config import EngineConfig
from workbench.engine.fork import apply_scheduling, first_divergence, set_priority
from workbench.engine.history import TIMING_STAGES, StepHistory
from workbench.metrics.perfetto import write_trace
from workbench.metrics.request_tracker import RequestTracker
from workbench.metrics.spec_stats import spec_decode_summary
from workbench.sampling_params import SamplingParams
from workbench.utils.heap import frozen_heap

logger = logging.getLogger(__name__)

CLOCKS = ("steps", "wall")
#: The unit of a rate on each clock, for messages.
_UNITS = {"steps": "step", "wall": "second"}
PERCENTILES = (50, 90, 99)
#: The latency columns summarised as percentiles, in seconds and in steps.
LATENCY_METRICS = ("ttft_s", "tpot_s", "e2e_s", "queue_s", "ttft_steps", "tpot_steps", "e2e_steps")


class ArrivingRequest(Protocol):
    """What :func:`drive` reads of a request: a :class:`workbench.lab.workload.WorkloadRequest`."""

    request_id: str
    prompt: str | tuple[int, ...]
    params: SamplingParams
    arrival_step: int | None
    arrival_time: float | None
    priority: int


@dataclass
class RunResult:
    """One workload run on one engine configuration.

    ``history``: the steps of this run (its own :class:`StepHistory`, so ``kv_state(step)``
    works); ``requests``: one row per request of the run (see
    :mod:`workbench.metrics.request_tracker`); ``outputs``: the final RequestOutput of each request
    by id; ``rejected``: request id -> the engine's error for requests it refused;
    ``wall_s``: the run's length on the engine's clock; ``simulated``: True for a run of
    :func:`workbench.lab.sim.simulate` (seconds are predicted, output tokens are fillers).
    """

    workload: Iterable[ArrivingRequest]  # a Workload
    config: EngineConfig
    clock: str
    history: StepHistory
    requests: object  # pandas DataFrame
    outputs: dict = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache at admissions
    prefix_hits: int = 0  # of those, tokens found
    tokenizer: object = field(default=None, repr=False)
    simulated: bool = False
    total_steps: int | None = None  # steps the run took; the history keeps the last max_history
    source: RunSource | None = field(default=None, repr=False, compare=False)  # how to run it again
    fork_step: int | None = None  # a branch (fork_at): the first step its changes shaped

    @property
    def branch(self) -> str:
        """What this run changed, in words: "original" or, for a branch, its changes from its fork step."""
        edits = self.source.edits if self.source is not None else ()
        return "; ".join(e.describe() for e in edits) or "original"

    def fork_at(self, step: int, *, policy=None, max_num_batched_tokens: int | None = None,
                max_num_seqs: int | None = None, enable_chunked_prefill: bool | None = None,
                abort: Iterable[str] = (), add: Iterable[ArrivingRequest] = (),
                priority: dict[str, int] | None = None) -> RunResult:
        """A branch of this run: steps ``0 .. step - 1`` are this run's, and from step ``step``
        on it runs with the changes -- scheduling (``policy``, ``max_num_batched_tokens``,
        ``max_num_seqs``, ``enable_chunked_prefill``) and request edits: ``abort`` (ids in
        flight, or not arrived yet: they never arrive), ``add`` (requests arriving from
        ``step`` on; an arrival before it counts as ``step``), ``priority`` {id: p} (in flight
        or still to arrive; needs a policy that reads priorities). A run that the ``priority``
        policy did not make gets its requests' workload priorities when a branch switches to it.

        The state at ``step`` is rebuilt by replaying the run from its start on a fresh engine
        (the run's :class:`RunSource`) and applying the earlier branches' edits at their steps:
        exact, because the step clock (or a simulated clock) repeats the schedule, sampling
        generators included; the replayed steps are checked against this run's records
        (RuntimeError naming the first difference otherwise). A real run on the wall clock
        does not repeat: ValueError (fork a live engine with ``engine.fork()`` instead). In a
        simulated branch an added request without ``ignore_eos`` runs to its ``max_tokens``.
        A branch of a real run has its own replay's wall seconds (``*_s``); its steps are exact.
        Forking a branch keeps its own edits, at their steps, and adds these.
        """
        source = self.source
        if source is None:
            raise ValueError("fork_at: this run cannot be run again (it was driven on an engine of yours): "
                             "fork runs of run_workload / simulate, or a live engine with engine.fork().")
        if not source.exact:
            raise ValueError("fork_at: a real run on the wall clock does not repeat step for step, so its state "
                             "at a step cannot be rebuilt; run the workload on the step clock "
                             "(Workload.poisson(..., clock='steps')), simulate it, or fork a live engine with engine.fork().")
        first = source.first_step
        if not isinstance(step, int) or isinstance(step, bool) or not first <= step <= first + self.num_steps:
            raise ValueError(f"fork_at: step must be an integer in [{first}, {first + self.num_steps}] (the run's "
                             f"steps), got {step!r}.")
        edit = ForkEdit(step, {k: v for k, v in dict(policy=policy, max_num_batched_tokens=max_num_batched_tokens,
                                                      max_num_seqs=max_num_seqs,
                                                      enable_chunked_prefill=enable_chunked_prefill).items()
                               if v is not None},
                        tuple(abort), tuple(add), dict(priority or {}))
        known = {r.request_id for r in source.requests()}
        clash = [r.request_id for r in edit.add if r.request_id in known]
        if clash:
            raise ValueError(f"fork_at: add: request_id {clash[0]!r} is already in the workload.")
        known |= {r.request_id for r in edit.add}
        for name, ids in (("abort", edit.abort), ("priority", edit.priority)):
            unknown = [rid for rid in ids if rid not in known]
            if unknown:
                raise ValueError(f"fork_at: {name}: request {unknown[0]!r} is not in the workload.")
        edits = tuple(sorted(source.edits + (edit,), key=lambda e: e.step))  # stable: same step, in order
        branch = dataclasses.replace(source, edits=edits).run(reference=self, check_before=step)
        return dataclasses.replace(branch, workload=RunSource.with_added(self.workload, list(edit.add)),
                                   simulated=self.simulated)

    def explain(self, request_id: str, step: int | None = None):
        """Why a request of this run waited, ran short or was preempted (see
        :meth:`StepHistory.explain <workbench.engine.history.StepHistory.explain>`)."""
        return self.history.explain(request_id, step)

    @property
    def num_steps(self) -> int:
        return len(self.history) if self.total_steps is None else self.total_steps

    @property
    def policy(self) -> str:
        policy = self.config.policy
        return policy if isinstance(policy, str) else getattr(policy, "name", type(policy).__name__)

    def summary(self) -> dict[str, float]:
        """Run-level numbers: p50/p90/p99 of each latency metric (``ttft_s_p50``, ...; NaN
        when no request has the metric), output tokens, throughput per second and per step,
        preemptions, recomputed tokens and the prefix-cache hit rate (hit / looked-up tokens
        at every admission, vLLM's); with speculative decoding also
        :func:`spec_decode_summary`'s acceptance rate and mean acceptance length."""
        frame = self.requests
        out: dict[str, float] = {
            "num_requests": len(frame),
            "num_finished": int(frame["finish_reason"].notna().sum()) if len(frame) else 0,
            "num_steps": self.num_steps,
        }
        for metric in LATENCY_METRICS:
            values = frame[metric].astype("float64").dropna() if len(frame) else frame
            for p in PERCENTILES:
                out[f"{metric}_p{p}"] = float(values.quantile(p / 100)) if len(values) else math.nan
        tokens = int(frame["num_output_tokens"].sum()) if len(frame) else 0
        out["output_tokens"] = tokens
        out["throughput_tok_s"] = tokens / self.wall_s if self.wall_s > 0 else math.nan
        out["throughput_tok_step"] = tokens / self.num_steps if self.num_steps else math.nan
        out["num_preemptions"] = int(frame["num_preemptions"].sum()) if len(frame) else 0
        out["num_recomputed_tokens"] = int(frame["num_recomputed_tokens"].sum()) if len(frame) else 0
        out["prefix_hit_rate"] = self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
        if self.config.speculative_config is not None:
            out.update(spec_decode_summary(self.history))
        return out

    def to_perfetto(self, path, *others: RunResult):
        """Write this run, and ``others`` (e.g. the simulated run of the same workload) beside it,
        as one Chrome trace-event JSON file: one process per run, each from time 0 (see
        :mod:`workbench.metrics.perfetto`). Returns the path."""
        runs, names = [], set()
        for i, run in enumerate((self, *others)):
            name = f"{'simulated' if run.simulated else 'real'} run ({run.policy})"
            name = name if name not in names else f"{name} #{i + 1}"
            names.add(name)
            runs.append((name, run.history))
        return write_trace(path, runs, stages=TIMING_STAGES)

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"RunResult({s['num_requests']} requests, {s['num_finished']} finished, {self.num_steps} steps, "
            f"clock={self.clock}, policy={self.policy}, ttft_steps_p50={s['ttft_steps_p50']:g}, "
            f"e2e_steps_p50={s['e2e_steps_p50']:g}, preemptions={s['num_preemptions']}, "
            f"recomputed_tokens={s['num_recomputed_tokens']}, prefix_hit_rate={s['prefix_hit_rate']:.2f}"
            + (f", rejected={sorted(self.rejected)}" if self.rejected else "")
            + (", simulated" if self.simulated else "")
            + ")"
        )

    def _repr_html_(self) -> str:
        s = self.summary()
        cells = "".join(
            f"<tr><th>{html.escape(k)}</th><td>{v:.4g}</td></tr>" if isinstance(v, float)
            else f"<tr><th>{html.escape(k)}</th><td>{v}</td></tr>"
            for k, v in s.items()
        )
        rejected = "".join(
            f"<li>{html.escape(rid)}: {html.escape(msg)}</li>" for rid, msg in self.rejected.items()
        )
        return (
            f"<div><b>{'Simulated ' if self.simulated else ''}RunResult</b>: {len(self.workload)} requests, clock={self.clock}, "
            f"policy={html.escape(self.policy)}<table>{cells}</table>"
            + (f"<b>rejected</b><ul>{rejected}</ul>" if rejected else "")
            + self.requests.head(20).to_html(index=False)
            + "</div>"
        )


@dataclass(frozen=True)
class ForkEdit:
    """The changes a branch makes at its fork step (see :meth:`RunResult.fork_at`)."""

    step: int
    scheduling: dict = field(default_factory=dict)
    abort: tuple[str, ...] = ()
    add: tuple = ()
    priority: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        parts = [f"{k}={getattr(v, 'name', v)}" for k, v in self.scheduling.items()]
        parts += [f"abort {rid}" for rid in self.abort] + [f"add {r.request_id}" for r in self.add]
        parts += [f"priority {rid}={p}" for rid, p in self.priority.items()]
        return f"from step {self.step}: {', '.join(parts) or 'nothing changed'}"

    def apply(self, driver: Driver) -> None:
        """Make the changes on a driver stopped before step ``step`` (ValueError naming what is wrong)."""
        engine = driver.engine
        in_flight = engine.output_processor.parents
        was_blind = not engine.uses_priority
        apply_scheduling(engine, **self.scheduling)
        by_id = {r.request_id: r for r in driver.workload}
        if was_blind and engine.uses_priority:  # the run added them with priority 0
            set_priority(engine, {rid: by_id[rid].priority for rid in in_flight if rid in by_id})
        if self.priority and not engine.uses_priority:
            raise ValueError(f"fork_at: priority: the {engine.scheduler.policy.name} policy reads no priority; "
                             "pass policy='priority' too.")
        pending = {r.request_id: r for r in driver.pending}
        for rid in self.abort:
            if rid not in in_flight and rid not in pending:
                raise ValueError(f"fork_at: abort: request {rid!r} is neither in flight nor still to arrive "
                                 f"at step {self.step} (it finished or was refused).")
        engine.abort_request([rid for rid in self.abort if rid in in_flight])
        set_priority(engine, {rid: p for rid, p in self.priority.items() if rid in in_flight})
        kept = [dataclasses.replace(r, priority=self.priority[r.request_id]) if r.request_id in self.priority else r
                for r in driver.pending if r.request_id not in self.abort]
        kept += [dataclasses.replace(r, priority=self.priority.get(r.request_id, r.priority),
                                     **self._not_before(driver, r)) for r in self.add]
        driver.pending = deque(sorted(kept, key=lambda r: _arrival(r, driver.clock)))  # earlier: at once
        driver.ids |= {r.request_id for r in self.add}

    def _not_before(self, driver: Driver, request: ArrivingRequest) -> dict:
        """An added request's arrival moved up to the fork, when it is earlier (its queue time
        starts there)."""
        if driver.clock == "steps":
            return {"arrival_step": max(request.arrival_step or 0, self.step)}
        now = driver.timer() - driver.t0
        return {"arrival_time": max(request.arrival_time or 0.0, now)}


@dataclass(frozen=True)
class RunSource:
    """How to run a RunResult again: ``make_engine()`` builds a fresh engine of the run's
    configuration, ``workload`` is what was driven through it on ``clock``, ``edits`` the
    branches' changes by step. ``exact``: a replay repeats the run step for step (the step
    clock, or a simulated clock; not a real run on the wall clock)."""

    make_engine: Callable[[], object]
    workload: Iterable[ArrivingRequest]
    clock: str
    exact: bool
    edits: tuple[ForkEdit, ...] = ()
    first_step: int = 0  # the engine's step number when the run started

    def requests(self) -> list:
        return [*self.workload, *(r for e in self.edits for r in e.add)]

    @staticmethod
    def with_added(workload, added: list):
        """``workload`` with the ``added`` requests (a Workload stays one)."""
        if not added:
            return workload
        if isinstance(workload, tuple):
            return (*workload, *added)
        return type(workload)([*workload, *added], getattr(workload, "info", None), clock=workload.clock)

    def run(self, reference: RunResult | None = None, check_before: int = 0) -> RunResult:
        """Run it again with the edits (in step order); the steps before ``check_before`` are
        checked against ``reference``'s records when given (RuntimeError at the first difference)."""
        engine = self.make_engine()
        fresh = not len(engine.history) and not engine.has_unfinished_requests()
        driver = Driver(engine, self.workload, clock=self.clock, exclusive=fresh)
        try:
            checked = reference is None
            for edit in self.edits:
                if not checked and edit.step >= check_before:
                    driver.run(until_step=check_before - self.first_step)
                    _check_replay(driver.history, reference.history, check_before)
                    checked = True
                driver.run(until_step=edit.step - self.first_step)
                edit.apply(driver)
            driver.run()
        finally:
            driver.close()
        return dataclasses.replace(driver.result(self), fork_step=check_before if self.edits else None)


def _check_replay(replayed: StepHistory, recorded: StepHistory, before: int) -> None:
    common = set(replayed.steps) & set(recorded.steps) & set(range(before))
    found = first_divergence([r for r in replayed if r.step in common], [r for r in recorded if r.step in common])
    if found is not None:
        raise RuntimeError(f"fork_at: replaying the run did not repeat it ({found!r}); its state at step "
                           f"{before} cannot be rebuilt exactly.")


def drive(engine, workload: Iterable[ArrivingRequest], *, clock: str | None = None, progress: bool = False,
          exclusive: bool = False, source: RunSource | None = None) -> RunResult:
    """Add ``workload``'s requests to ``engine`` as they arrive and step it until nothing is
    unfinished (requests already in flight included). The engine's ``on_step`` hooks see
    every step; the result keeps the steps of this run only. ``exclusive``: the engine was
    built for this run and has not stepped (run_workload, simulate): its own history and
    request tracker become the result's, instead of copies kept step by step. ``clock``:
    None for the workload's own (see the module docstring). ``source``: how to run it again
    (:meth:`RunResult.fork_at` needs one)."""
    driver = Driver(engine, workload, clock=clock, progress=progress, exclusive=exclusive)
    try:
        driver.run()
    finally:
        driver.close()
    return driver.result(source)


class Driver:
    """:func:`drive` in pieces: ``run(until_step)`` steps the engine (adding arrivals) until
    it took ``until_step`` steps of this run or all is done; between calls the pending
    arrivals (``pending``, in arrival order) and the engine may be edited (a fork's changes);
    ``close()`` unhooks it; ``result()`` is the RunResult so far."""

    def __init__(self, engine, workload: Iterable[ArrivingRequest], *, clock: str | None = None,
                 progress: bool = False, exclusive: bool = False) -> None:
        clock = run_clock(workload, clock)
        if isinstance(workload, (list, tuple)):
            workload = tuple(workload)
        if isinstance(workload, (str, bytes)) or not isinstance(workload, Iterable) or not isinstance(workload, Sized):
            raise ValueError(f"workload must be a Workload or a list of WorkloadRequest, got {type(workload).__name__}.")
        if exclusive and (len(engine.history) or engine.has_unfinished_requests()):
            raise ValueError("drive(exclusive=True) needs an engine that has not stepped and holds no request.")
        self.engine, self.workload, self.clock, self.exclusive = engine, workload, clock, exclusive
        self.pending = deque(sorted(workload, key=lambda r: _arrival(r, clock)))  # stable: ties keep order
        self.timer = engine.clock
        # A simulated clock jumps; a real engine waits keeping its CPU threads awake.
        self._sleep = getattr(self.timer, "sleep", None) or engine.idle.sleep
        self._input_processed = getattr(self.timer, "input_processed", None)  # a simulated clock prices it
        self.t0 = self.timer()
        self.tracker = RequestTracker(epoch=self.t0, max_requests=max(100_000, len(workload)))
        if exclusive:
            self.history, engine.request_tracker = engine.history, self.tracker
        else:
            self.history = StepHistory(engine.config.max_history, initial_kv_state=engine.history.kv_state())
            engine.on_step.append(self._keep)
        stats = engine.kv_cache.prefix_cache_stats
        self._prefix0 = (stats.queries, stats.hits)
        self.ids = {r.request_id for r in workload}
        self.outputs, self.rejected = {}, {}
        self.step = 0  # steps of this run so far
        self._bar = _progress_bar(len(workload), progress)

    def _keep(self, record) -> None:
        self.history.append(record)
        self.tracker.consume(record.request_events)

    def run(self, until_step: int | None = None) -> None:
        engine, clock, pending = self.engine, self.clock, self.pending
        with frozen_heap() as refreeze:  # long-lived objects stay out of the collector's way
            while until_step is None or self.step < until_step:
                refreeze()  # the records kept so far too
                now = self.step if clock == "steps" else self.timer() - self.t0
                while pending and _arrival(pending[0], clock) <= now:
                    self._add(pending.popleft())
                # An abort (a fork's edit) that left nothing to run is recorded by one more step.
                if not engine.has_unfinished_requests() and not engine.has_unrecorded_aborts():
                    if not pending:
                        break
                    if clock == "wall":
                        self._sleep(max(0.0, _arrival(pending[0], clock) - (self.timer() - self.t0)))
                        continue
                for out in engine.step():
                    if out.finished and out.request_id in self.ids:
                        self.outputs[out.request_id] = out
                        self._bar.update(1)
                self.step += 1

    def _add(self, request: ArrivingRequest) -> None:
        engine = self.engine
        try:
            engine.add_request(
                request.request_id,
                request.prompt,
                request.params,
                # A policy that ignores priorities (fcfs, spf) runs the same workload.
                priority=request.priority if engine.uses_priority else 0,
                arrival_time=self.t0 + _arrival(request, "wall") if self.clock == "wall" else None,
                lora_request=getattr(request, "lora_request", None),
            )
            if self._input_processed is not None and isinstance(request.prompt, str):
                self._input_processed(len(engine.output_processor.parents[request.request_id].prompt_token_ids))
        except ValueError as e:
            self.rejected[request.request_id] = str(e)
            logger.warning("request %r left out of the run: %s", request.request_id, e)
            self._bar.update(1)

    def close(self) -> None:
        if not self.exclusive and self._keep in self.engine.on_step:
            self.engine.on_step.remove(self._keep)
        self._bar.close()

    def result(self, source: RunSource | None = None) -> RunResult:
        engine, stats = self.engine, self.engine.kv_cache.prefix_cache_stats
        return RunResult(
            workload=self.workload,
            config=engine.config,
            clock=self.clock,
            history=self.history,
            requests=self.tracker.dataframe(),
            outputs=self.outputs,
            rejected=self.rejected,
            wall_s=self.timer() - self.t0,
            prefix_queries=stats.queries - self._prefix0[0],
            prefix_hits=stats.hits - self._prefix0[1],
            tokenizer=engine.tokenizer,
            total_steps=self.step,
            source=source,
        )


def run_clock(workload, clock: str | None) -> str:
    """The clock a run of ``workload`` is on: its own (``workload.clock``; the step clock for
    a plain list of requests), which ``clock``, when given, must name."""
    own = getattr(workload, "clock", None)
    resolved = clock or own or "steps"
    if resolved not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}.")
    if own is not None and resolved != own:
        raise ValueError(
            f"this workload's arrivals are on the {own} clock (its rates are per {_UNITS[own]}) and this run "
            f"asks for clock={clock!r}: leave clock out to run it on its own clock, or build it for the "
            f"{clock} clock (e.g. Workload.poisson(..., clock={clock!r}), a rate per {_UNITS[clock]}); "
            f"workload.on_clock({clock!r}) reads its numbers as {_UNITS[clock]}s instead."
        )
    return resolved


def _arrival(request: ArrivingRequest, clock: str) -> float:
    """The request's arrival in ``clock``'s unit; a request with neither arrival comes at 0."""
    if clock == "steps":
        if request.arrival_step is None and request.arrival_time is not None:
            raise ValueError(
                f"request {request.request_id!r} has arrival_time but no arrival_step; "
                f"use clock='wall' or give arrival_step."
            )
        return request.arrival_step or 0
    if request.arrival_time is None and request.arrival_step is not None:
        raise ValueError(
            f"request {request.request_id!r} has arrival_step but no arrival_time; "
            f"use clock='steps' or give arrival_time."
        )
    return request.arrival_time or 0.0


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req", disable=not enabled)


def replay_workload(engine, workload, *, clock: str | None = None, progress: bool = False,
                    forkable: bool = False) -> RunResult:
    """Drive an existing ``engine`` through ``workload`` on its clock (steps or wall; ``clock``,
    when given, must be it) until every request finished; returns a :class:`RunResult` of the
    steps it took. ``forkable``: the result keeps a fork of the engine as it was before the run
    (its KV cache included: twice the memory), so that ``result.fork_at(step)`` can rebuild any
    of its steps (a run on the step clock, or on a simulated clock)."""
    source = None
    if forkable:
        clock = run_clock(workload, clock)
        start = engine.fork()
        source = RunSource(start.fork, workload, clock, exact=clock == "steps" or hasattr(engine.clock, "sleep"),
                           first_step=engine.scheduler.step_count)
    return drive(engine, workload, clock=clock, progress=progress, source=source)
