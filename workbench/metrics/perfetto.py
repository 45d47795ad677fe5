"""Chrome trace-event JSON of engine runs, for ui.perfetto.dev and chrome://tracing.

Built from StepRecords (their timings, stats, KV and request events) and nothing else. Each
run is one process of the trace with:

* an ``engine`` track: one slice per step, the stage slices nested in it (a simulated step:
  one ``simulated`` slice, the cost model's duration);
* one track per request: a ``request`` slice from arrival to finish (``B``/``E``) holding
  ``waiting`` (arrival -> first scheduled), ``preempted`` (preemption -> resumed) -- their
  args' ``reasons``: {reason: steps} from the records' why -- a slice per
  prefill chunk (``recompute`` when it recomputes tokens lost to a preemption), ``decode``
  (consecutive decode steps), and instants ``first token`` and ``finished: REASON``;
* counter tracks ``running``, ``waiting``, ``kv usage (%)`` and ``tokens`` (prefill, decode),
  sampled at each step's end;
* a flow arrow from each preemption to the request whose block allocation it made room for
  (the next allocation after the victim's blocks were freed);
* with a KV connector, a ``kv transfers`` track: each load received (bytes, blocks, modelled
  time on the link) and each request's blocks held for a peer.

With async scheduling (records with an ``overlap``) the steps overlap, so the ``engine`` track
holds the engine thread's own slices -- ``schedule N``, ``wait N`` (blocked on step N's batch)
and ``update N`` -- where they ran, and a ``worker: forward`` track one ``step N`` slice per
batch: the host work of step N+1 shows under the forward of step N. The spans (perf_counter)
are moved onto the engine clock by the first such step's schedule.

Times are microseconds from the run's first event. A step starts at its schedule's clock
reading (the time of its requests' scheduling events), or, with none, where the previous step
ended plus the driver's gap; never before the previous step's end. Events of a request whose
arrival is not among the records are left out.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from workbench.core.sched.explain import reason_counts
from workbench.core.kv_events import BlockAllocated, BlockFreed
from workbench.core.request_events import (
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPreempted,
    RequestPrefixHit,
    RequestResumed,
    RequestScheduled,
)

#: Events written at the schedule's one clock reading: they place their step in time.
_SCHEDULE_EVENTS = (RequestScheduled, RequestPreempted, RequestResumed, RequestPrefixHit)
ENGINE_TID = 0
#: The worker thread's track (async scheduling): after the request tracks' ids.
WORKER_TID = 1_000_000


def _us(seconds: float) -> float:
    """Seconds -> trace microseconds, kept to the nanosecond."""
    return round(seconds * 1e6, 3)


@dataclass
class _Life:
    """One request's events, gathered for its track."""

    arrived: RequestArrived
    events: list = field(default_factory=list)


def _place_steps(records: Sequence, stages: Sequence[str]) -> dict[int, tuple[float, list[tuple[str, float]]]]:
    """step -> (start on the engine clock, [(stage, seconds)]); see the module docstring."""
    anchors: dict[int, float] = {}
    for record in records:
        for e in record.request_events:
            if isinstance(e, _SCHEDULE_EVENTS):
                anchors.setdefault(e.step, e.time)
    placed = {}
    end = None
    for record in records:
        t = record.timings
        parts = [("simulated", t["simulated"])] if "simulated" in t else [(s, t[s]) for s in stages if s in t]
        start = anchors.get(record.step)
        if start is None:
            start = (end if end is not None else 0.0) + t.get("driver", 0.0)
        if end is not None:
            start = max(start, end)
        placed[record.step] = (start, parts)
        end = start + sum(d for _, d in parts)
    overlapped = [r for r in records if r.overlap is not None and "forward" in r.overlap.spans]
    if overlapped:  # async scheduling: each step where its batch ran on the worker
        shift = placed[overlapped[0].step][0] - overlapped[0].overlap.spans["schedule"][0]
        for r in overlapped:
            begin, finish = r.overlap.spans["forward"]
            placed[r.step] = (begin + shift, [("forward", finish - begin)])
    return placed


def _overlap_events(records: Sequence, placed, pid: int, ts) -> list[dict]:
    """Async scheduling's host slices on the engine track and the worker's track (see the
    module docstring); none for synchronous records."""
    overlapped = [r for r in records if r.overlap is not None and "forward" in r.overlap.spans]
    if not overlapped:
        return []
    first = overlapped[0]
    shift = placed[first.step][0] - first.overlap.spans["forward"][0]
    events = [{"ph": "M", "pid": pid, "tid": WORKER_TID, "name": "thread_name",
               "args": {"name": "worker: forward"}},
              {"ph": "M", "pid": pid, "tid": WORKER_TID, "name": "thread_sort_index", "args": {"sort_index": 0}}]
    for r in overlapped:
        for stage, (begin, finish) in r.overlap.spans.items():
            tid, name = (WORKER_TID, f"step {r.step}") if stage == "forward" else (ENGINE_TID, f"{stage} {r.step}")
            event = {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": "stage",
                     "ts": ts(begin + shift), "dur": round(ts(finish + shift) - ts(begin + shift), 3)}
            if stage == "forward":
                event["args"] = {"scheduled_under": r.overlap.scheduled_under,
                                 "placeholders": list(r.overlap.placeholders),
                                 "deferred": list(r.overlap.deferred), "discarded": list(r.overlap.discarded)}
            events.append(event)
    return events


def _beneficiaries(record) -> dict[str, str]:
    """victim id -> the request whose allocation its preemption made room for, in this step."""
    victims = set(record.scheduler_output.preempted_request_ids)
    out, freed = {}, []
    for e in record.kv_events:
        if isinstance(e, BlockFreed) and e.request_id in victims:
            if e.request_id not in freed:
                freed.append(e.request_id)
        elif isinstance(e, BlockAllocated) and freed:
            for victim in freed:
                if victim != e.request_id:
                    out[victim] = e.request_id
            freed = []
    return out


def trace_events(records: Iterable, *, pid: int = 1, name: str = "engine",
                 stages: Sequence[str] = ()) -> list[dict]:
    """The trace events of one run's StepRecords as process ``pid`` named ``name``;
    ``stages``: the timing stages to draw, in order (TIMING_STAGES)."""
    records = list(records)
    placed = _place_steps(records, stages)
    times = [start for start, _ in placed.values()]
    lives: list[_Life] = []
    live: dict[str, _Life] = {}
    for record in records:
        for e in record.request_events:
            if isinstance(e, RequestArrived):
                live[e.request_id] = _Life(e)
                lives.append(live[e.request_id])
                times.append(e.time)
            elif e.request_id in live:
                live[e.request_id].events.append(e)
                if isinstance(e, RequestFinished):
                    del live[e.request_id]
    origin = min(times, default=0.0)

    def ts(seconds: float) -> float:
        return _us(seconds - origin)

    events: list[dict] = [
        {"ph": "M", "pid": pid, "tid": ENGINE_TID, "name": "process_name", "args": {"name": name}},
        {"ph": "M", "pid": pid, "tid": ENGINE_TID, "name": "thread_name", "args": {"name": "engine"}},
        {"ph": "M", "pid": pid, "tid": ENGINE_TID, "name": "thread_sort_index", "args": {"sort_index": -1}},
    ]
    step_ends: dict[int, float] = {}
    events += _overlap_events(records, placed, pid, ts)
    for record in records:
        start, parts = placed[record.step]
        total = sum(d for _, d in parts)
        step_ends[record.step] = start + total
        row = {k: v for k, v in record.to_row().items() if not k.startswith("t_")}
        end = ts(start + total)
        overlapped = record.overlap is not None and "forward" in record.overlap.spans
        if not overlapped:  # (async scheduling's steps: _overlap_events)
            events.append({"ph": "X", "pid": pid, "tid": ENGINE_TID, "name": f"step {record.step}", "cat": "step",
                           "ts": ts(start), "dur": round(end - ts(start), 3), "args": row})
        at = start
        for stage, seconds in ([] if overlapped else parts):  # from rounded boundaries, so a stage ends where the next begins
            events.append({"ph": "X", "pid": pid, "tid": ENGINE_TID, "name": stage, "cat": "stage",
                           "ts": ts(at), "dur": round(ts(at + seconds) - ts(at), 3)})
            at += seconds
        for counter, args in (
            ("running", {"running": record.num_running}),
            ("waiting", {"waiting": record.num_waiting}),
            ("kv usage (%)", {"kv usage (%)": round(100 * record.kv_usage, 6)}),
            ("tokens", {"prefill": record.num_prefill_tokens, "decode": record.num_decode_tokens}),
        ):
            events.append({"ph": "C", "pid": pid, "tid": ENGINE_TID, "name": counter, "ts": end, "args": args})
    beneficiaries = {(r.step, v): b for r in records for v, b in _beneficiaries(r).items()}
    flows = {key: pid * 1_000_000 + i  # (step, beneficiary) -> flow id, unique in the trace
             for i, key in enumerate(sorted(set((step, b) for (step, _), b in beneficiaries.items())))}
    run_end = max(step_ends.values(), default=origin)
    reasons = {r.step: r.reasons for r in records}  # a wait's args: its steps' reasons
    for i, life in enumerate(lives):
        events += _request_track(life, pid, ENGINE_TID + 1 + i, ts, placed, step_ends, run_end, beneficiaries,
                                 flows, reasons)
    events += _kv_transfer_track(records, lives, pid, ENGINE_TID + 1 + len(lives), ts, step_ends)
    return events


def _kv_transfer_track(records, lives, pid: int, tid: int, ts, step_ends) -> list[dict]:
    """The KV connector's track (prefill/decode disaggregation): a ``kv transfer`` slice per
    load this engine received (its modelled interval on the link, with blocks, bytes and the
    producer), and a ``kv held`` slice per request whose blocks this engine held for a peer
    (from its finish to the step that learned they were read). Empty without a connector."""
    out: list[dict] = []
    finished = {e.request_id: e.time for life in lives for e in life.events if isinstance(e, RequestFinished)}
    for record in records:
        kv = getattr(record, "kv_connector_output", None)
        if kv is None:
            continue
        for t in kv.transfers:
            out.append({"ph": "X", "pid": pid, "tid": tid, "name": f"kv transfer {t.request_id}", "cat": "kv_transfer",
                        "ts": ts(t.start), "dur": round(ts(t.end) - ts(t.start), 3),
                        "args": {"num_blocks": t.num_blocks, "num_bytes": t.num_bytes, "seconds": t.seconds,
                                 "remote_engine_id": t.remote_engine_id, "remote_request_id": t.remote_request_id}})
        for rid in sorted(kv.finished_sending):
            if rid in finished:
                end = step_ends[record.step]
                out.append({"ph": "X", "pid": pid, "tid": tid, "name": f"kv held {rid}", "cat": "kv_transfer",
                            "ts": ts(finished[rid]), "dur": round(ts(end) - ts(finished[rid]), 3)})
    if out:
        out.insert(0, {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": "kv transfers"}})
    return out


def _request_track(life: _Life, pid: int, tid: int, ts, placed, step_ends, run_end: float, beneficiaries,
                   flows, reasons) -> list[dict]:
    """One request's track (see the module docstring); an unfinished request's ends with the run."""
    a = life.arrived
    rid = a.request_id
    finish = next((e for e in life.events if isinstance(e, RequestFinished)), None)
    end_time = finish.time if finish is not None else max(run_end, a.time)

    def slice_(name, begin, stop, cat, **args):
        begin, stop = max(begin, a.time), min(stop, end_time)
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": cat, "ts": ts(begin),
                "dur": max(0.0, round(ts(stop) - ts(begin), 3)), "args": args}

    out = [
        {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": f"request {rid}"}},
        {"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}},
        {"ph": "B", "pid": pid, "tid": tid, "name": f"request {rid}", "cat": "request", "ts": ts(a.time),
         "args": {"request_id": rid, "num_prompt_tokens": a.num_prompt_tokens, "priority": a.priority,
                  "arrival_step": a.step}},
    ]
    wait_from, wait_name, wait_step = a.time, "waiting", a.step

    def wait_args(until_step: int) -> dict:
        return {"reasons": reason_counts(reasons, rid, wait_step, until_step)}
    lost = 0  # tokens computed before the latest preemption
    decode = None  # [start, stop, tokens, first step, last step] of the open decode slice

    def close_decode():
        nonlocal decode
        if decode is not None:
            out.append(slice_("decode", decode[0], decode[1], "decode", num_tokens=decode[2],
                              steps=[decode[3], decode[4]]))
            decode = None

    for e in life.events:
        if isinstance(e, RequestScheduled):
            if wait_from is not None:
                out.append(slice_(wait_name, wait_from, e.time, wait_name, **wait_args(e.step)))
                wait_from = None
            start, stop = placed[e.step][0], step_ends[e.step]
            if (e.step, rid) in flows:  # a preemption in this step made room for this chunk
                out.append({"ph": "f", "bp": "e", "pid": pid, "tid": tid, "name": "preemption",
                            "cat": "preemption", "id": flows[(e.step, rid)], "ts": ts(start)})
            if e.is_prefill:
                close_decode()
                recomputed = max(0, min(e.start + e.num_tokens, lost) - e.start)
                name = "recompute" if recomputed else "prefill"
                out.append(slice_(f"{name} [{e.start}, {e.start + e.num_tokens})", start, stop, name,
                                  step=e.step, num_computed_tokens=e.start, num_tokens=e.num_tokens,
                                  num_recomputed_tokens=recomputed))
            elif decode is None:
                decode = [start, stop, 1, e.step, e.step]
            else:
                decode[1], decode[2], decode[4] = stop, decode[2] + 1, e.step
        elif isinstance(e, RequestPreempted):
            close_decode()
            wait_from, wait_name, lost, wait_step = e.time, "preempted", e.num_computed_tokens, e.step
            beneficiary = beneficiaries.get((e.step, rid))
            if beneficiary is not None:
                out.append({"ph": "s", "pid": pid, "tid": tid, "name": "preemption", "cat": "preemption",
                            "id": flows[(e.step, beneficiary)], "ts": ts(e.time)})
        elif isinstance(e, RequestFirstToken):
            out.append({"ph": "i", "s": "t", "pid": pid, "tid": tid, "name": "first token", "cat": "token",
                        "ts": ts(e.time)})
        elif isinstance(e, RequestFinished):
            close_decode()
            out.append({"ph": "i", "s": "t", "pid": pid, "tid": tid, "name": f"finished: {e.reason}",
                        "cat": "finished", "ts": ts(e.time),
                        "args": {"reason": e.reason, "num_output_tokens": e.num_output_tokens}})
    close_decode()
    if wait_from is not None:
        out.append(slice_(wait_name, wait_from, end_time, wait_name, **wait_args(max(reasons, default=0) + 1)))
    out.append({"ph": "E", "pid": pid, "tid": tid, "name": f"request {rid}", "cat": "request",
                "ts": ts(end_time), "args": {"finished": finish is not None}})
    # Time order; at one instant the span opens first and closes last, and of two sibling
    # slices the shorter (a zero-length wait) comes before the one it precedes.
    rank = {"M": -1, "B": 0, "X": 1, "s": 2, "f": 2, "i": 2, "E": 3}
    out.sort(key=lambda ev: (ev["ph"] != "M", ev.get("ts", 0.0), rank[ev["ph"]], ev.get("dur", 0.0)))
    return out


def write_trace(path, runs: Sequence[tuple[str, Iterable]], *, stages: Sequence[str] = ()) -> pathlib.Path:
    """Write the runs (``(name, records)`` each, one process apiece, side by side from time 0)
    as one Chrome trace-event JSON file; returns its path."""
    events: list[dict] = []
    for pid, (name, records) in enumerate(runs, start=1):
        events += trace_events(records, pid=pid, name=name, stages=stages)
    path = pathlib.Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path
