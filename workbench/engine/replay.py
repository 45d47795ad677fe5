"""RunResult and drive(): an engine driven through a workload's arrivals, and what the run recorded.

``LLMEngine.replay(workload)`` drives an existing engine; :func:`workbench.lab.run.run_real`
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

import html
import logging
import math
from collections import deque
from collections.abc import Iterable, Sized
from dataclasses import dataclass, field
from typing import Protocol

from workbench.config import EngineConfig
from workbench.engine.history import TIMING_STAGES, StepHistory
from workbench.metrics.perfetto import write_trace
from workbench.metrics.request_tracker import RequestTracker
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


def spec_decode_summary(records) -> dict[str, float]:
    """Speculative decoding over ``records`` (StepRecords): ``spec_num_drafts`` (verifications),
    ``spec_num_draft_tokens``, ``spec_num_accepted_tokens``, ``spec_acceptance_rate``
    (accepted / drafted tokens) and ``spec_mean_acceptance_length`` (vLLM's: tokens a
    verification emits on average, 1 + accepted / drafts); NaN rates without drafts."""
    results = [r for rec in records for r in rec.spec_decode.values()]
    drafted = sum(r.num_draft_tokens for r in results)
    accepted = sum(r.num_accepted for r in results)
    return {
        "spec_num_drafts": len(results),
        "spec_num_draft_tokens": drafted,
        "spec_num_accepted_tokens": accepted,
        "spec_acceptance_rate": accepted / drafted if drafted else math.nan,
        "spec_mean_acceptance_length": 1 + accepted / len(results) if results else math.nan,
    }


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


def drive(engine, workload: Iterable[ArrivingRequest], *, clock: str | None = None, progress: bool = False,
          exclusive: bool = False) -> RunResult:
    """Add ``workload``'s requests to ``engine`` as they arrive and step it until nothing is
    unfinished (requests already in flight included). The engine's ``on_step`` hooks see
    every step; the result keeps the steps of this run only. ``exclusive``: the engine was
    built for this run and has not stepped (run_workload, simulate): its own history and
    request tracker become the result's, instead of copies kept step by step. ``clock``:
    None for the workload's own (see the module docstring)."""
    clock = run_clock(workload, clock)
    if isinstance(workload, (list, tuple)):
        workload = tuple(workload)
    if isinstance(workload, (str, bytes)) or not isinstance(workload, Iterable) or not isinstance(workload, Sized):
        raise ValueError(f"workload must be a Workload or a list of WorkloadRequest, got {type(workload).__name__}.")
    pending = deque(sorted(workload, key=lambda r: _arrival(r, clock)))  # stable: ties keep order
    if exclusive and (len(engine.history) or engine.has_unfinished_requests()):
        raise ValueError("drive(exclusive=True) needs an engine that has not stepped and holds no request.")
    timer = engine.clock
    # A simulated clock jumps; a real engine waits keeping its CPU threads awake.
    sleep = getattr(timer, "sleep", None) or engine.idle.sleep
    input_processed = getattr(timer, "input_processed", None)  # a simulated clock prices it
    t0 = timer()
    tracker = RequestTracker(epoch=t0, max_requests=max(100_000, len(workload)))
    if exclusive:
        history, engine.request_tracker = engine.history, tracker
    else:
        history = StepHistory(engine.config.max_history, initial_kv_state=engine.history.kv_state())
    stats = engine.kv_cache.prefix_cache_stats
    queries0, hits0 = stats.queries, stats.hits
    ids = {r.request_id for r in workload}
    outputs, rejected = {}, {}
    bar = _progress_bar(len(workload), progress)

    def keep(record) -> None:
        history.append(record)
        tracker.consume(record.request_events)

    if not exclusive:
        engine.on_step.append(keep)
    try:
        with frozen_heap():  # long-lived objects stay out of the collector's way
            step = 0
            while True:
                now = step if clock == "steps" else timer() - t0
                while pending and _arrival(pending[0], clock) <= now:
                    request = pending.popleft()
                    try:
                        engine.add_request(
                            request.request_id,
                            request.prompt if isinstance(request.prompt, str) else list(request.prompt),
                            request.params,
                            # A policy that ignores priorities (fcfs, spf) runs the same workload.
                            priority=request.priority if engine.uses_priority else 0,
                            arrival_time=t0 + request.arrival_time if clock == "wall" else None,
                        )
                        if input_processed is not None and isinstance(request.prompt, str):
                            input_processed(len(engine.output_processor.parents[request.request_id].prompt_token_ids))
                    except ValueError as e:
                        rejected[request.request_id] = str(e)
                        logger.warning("request %r left out of the run: %s", request.request_id, e)
                        bar.update(1)
                if not engine.has_unfinished_requests():
                    if not pending:
                        break
                    if clock == "wall":
                        sleep(max(0.0, _arrival(pending[0], clock) - (timer() - t0)))
                        continue
                for out in engine.step():
                    if out.finished and out.request_id in ids:
                        outputs[out.request_id] = out
                        bar.update(1)
                step += 1
    finally:
        if not exclusive:
            engine.on_step.remove(keep)
        bar.close()
    return RunResult(
        workload=workload,
        config=engine.config,
        clock=clock,
        history=history,
        requests=tracker.dataframe(),
        outputs=outputs,
        rejected=rejected,
        wall_s=timer() - t0,
        prefix_queries=stats.queries - queries0,
        prefix_hits=stats.hits - hits0,
        tokenizer=engine.tokenizer,
        total_steps=step,
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
