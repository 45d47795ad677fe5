"""BatchQueue: async scheduling's batch queue of two (vLLM's ``EngineCore.step_with_batch_queue``).

The runner executes on one worker thread (torch releases the GIL in its kernels), so the engine
thread schedules step N+1 -- and updates, detokenizes and records step N -- while step N+1's
forward runs. Batches execute one at a time, in the order submitted: when step N+1 starts, step
N's tokens are known on the worker, which fills step N+1's placeholders with them
(``PLACEHOLDER_TOKEN_ID`` inputs: see :mod:`workbench.core.sched.async_scheduler`) before the
runner sees the batch. The record keeps the scheduler's own output, placeholders and all.

With ``inline`` (an engine on a caller's clock: the simulator's) there is no thread: a batch
runs when the engine waits for it, so the clock is read and advanced in step order, the same on
every run; the steps are scheduled one ahead all the same.

Blocks freed while a step is in flight (a request finished or preempted by the engine thread)
may be handed to another request by the next ``schedule()``; that request's batch executes
after the in-flight one, so no write of the old step lands after a write of the new one; and the
positions a step in flight writes are never in a cached block (cached blocks hold known tokens).
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import msgspec

from workbench.core.sched.async_scheduler import PLACEHOLDER_TOKEN_ID
from workbench.core.sched.output import SchedulerOutput
from workbench.request import Request
from workbench.utils.frozen import FrozenDict


@dataclass(frozen=True)
class StepOverlap:
    """How one step of async scheduling overlapped (``StepRecord.overlap``; None: synchronous).

    ``scheduled_under``: the step in flight (queued, not yet updated) while this step was
    scheduled, None when none was; whether its forward was still running then, the spans say. ``placeholders``: the requests whose input token was a placeholder (the
    token the previous step sampled, unknown when this step was scheduled). ``deferred``: the
    requests that needed that token on the host (a grammar, penalties, ``min_tokens``...), so
    this step's batch waited for the previous step's update before it started. ``discarded``:
    the requests finished by the previous step (a stop found one step late) whose token from
    this step was dropped. ``spans``: perf_counter ``(start, end)`` of this step's "schedule",
    its "forward" (the runner's whole execute, on the worker thread), the engine thread's
    "wait" for it and its "update" (update, outputs, record) -- drawn by the timeline and the
    Perfetto export; wall-clock, so left out of comparisons."""

    scheduled_under: int | None
    placeholders: tuple[str, ...] = ()
    deferred: tuple[str, ...] = ()
    discarded: tuple[str, ...] = ()
    spans: Mapping[str, tuple[float, float]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if type(self.spans) is not FrozenDict:
            object.__setattr__(self, "spans", FrozenDict(self.spans))


@dataclass
class InFlight:
    """A step handed to the worker (``future`` None while ``deferred``)."""

    scheduler_output: SchedulerOutput
    requests: dict[str, Request]
    scheduled_under: int | None
    schedule_span: tuple[float, float]
    deferred: tuple[str, ...]
    future: Future | None = None


def fill_placeholders(scheduler_output: SchedulerOutput, last_sampled: Mapping[str, int]) -> SchedulerOutput:
    """``scheduler_output`` with each chunk's placeholder input (always its last token) replaced
    by the token its request sampled last (0 for a request whose row failed: its output is
    dropped); itself when it holds none."""
    chunks = scheduler_output.scheduled
    if not any(c.token_ids and c.token_ids[-1] == PLACEHOLDER_TOKEN_ID for c in chunks):
        return scheduler_output
    return replace(scheduler_output, scheduled=tuple(
        msgspec.structs.replace(c, token_ids=c.token_ids[:-1] + (last_sampled.get(c.request_id, 0),))
        if c.token_ids and c.token_ids[-1] == PLACEHOLDER_TOKEN_ID else c for c in chunks))


class InlineFuture:
    """A batch run on the caller's thread when its result is first asked for (``inline``)."""

    def __init__(self, call) -> None:
        self._call, self._outcome = call, None

    def _run(self) -> tuple:
        if self._outcome is None:
            try:
                self._outcome = (self._call(), None)
            except Exception as exc:  # noqa: BLE001 - handed to whoever asks for the result
                self._outcome = (None, exc)
        return self._outcome

    def result(self):
        value, exc = self._run()
        if exc is not None:
            raise exc
        return value

    def exception(self):
        return self._run()[1]


class BatchQueue:
    """At most ``max_size`` steps scheduled and not yet updated, oldest first; their batches
    run on one worker thread in that order (``inline``: on the engine's, when waited for)."""

    def __init__(self, runner, max_size: int = 2, *, inline: bool = False) -> None:
        self._runner = runner
        self.max_size = max_size
        self.inline = inline
        self._queue: deque[InFlight] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self._last_sampled: dict[str, int] = {}  # the worker thread's own

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def full(self) -> bool:
        return len(self._queue) >= self.max_size

    @property
    def in_flight_step(self) -> int | None:
        """The newest step queued (its batch submitted or deferred, its update not done), else
        None: the step the next one is scheduled under."""
        return self._queue[-1].scheduler_output.step if self._queue else None

    def add(self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request],
            schedule_span: tuple[float, float], scheduled_under: int | None,
            deferred: tuple[str, ...], grammar_bitmask=None) -> InFlight:
        """Queue a scheduled step; it executes at once unless ``deferred`` (then
        :meth:`submit` starts it once the previous step is updated)."""
        entry = InFlight(scheduler_output, {c.request_id: requests[c.request_id]
                                            for c in scheduler_output.scheduled},
                         scheduled_under, schedule_span, deferred)
        self._queue.append(entry)
        if not deferred:
            self.submit(entry, grammar_bitmask)
        return entry

    def submit(self, entry: InFlight, grammar_bitmask=None) -> None:
        if self.inline:
            entry.future = InlineFuture(lambda: self._execute(entry.scheduler_output, entry.requests,
                                                              grammar_bitmask))
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="workbench-execute")
        entry.future = self._pool.submit(self._execute, entry.scheduler_output, entry.requests,
                                         grammar_bitmask)

    def _execute(self, scheduler_output, requests, grammar_bitmask):
        """On the worker: fill the placeholders, run the batch, keep its tokens."""
        start = time.perf_counter()
        last = self._last_sampled
        for rid in scheduler_output.finished_request_ids:
            last.pop(rid, None)
        out = self._runner.execute(fill_placeholders(scheduler_output, last), requests, grammar_bitmask)
        last.update(out.sampled_token_ids)
        return out, (start, time.perf_counter())

    def peek(self) -> InFlight:
        return self._queue[0]

    def pop(self) -> InFlight:
        """The oldest step, out of the queue (its ``future`` gives ``(RunnerOutput, forward
        span)``, or raises the runner's exception)."""
        return self._queue.popleft()

    def wait(self) -> None:
        """Block until every submitted batch has run (raising nothing)."""
        for entry in self._queue:
            if entry.future is not None:
                entry.future.exception()

    def __deepcopy__(self, memo) -> BatchQueue:
        """A fork's queue (:mod:`workbench.engine.fork`): the same steps in flight, their
        batches run already (this waits for them), as completed futures of copied results."""
        self.wait()
        new = BatchQueue(copy.deepcopy(self._runner, memo), self.max_size, inline=self.inline)
        new._last_sampled = dict(self._last_sampled)
        for entry in self._queue:
            future = None
            if entry.future is not None:
                future = Future()
                if entry.future.exception() is not None:
                    future.set_exception(entry.future.exception())
                else:
                    future.set_result(copy.deepcopy(entry.future.result(), memo))
            new._queue.append(InFlight(copy.deepcopy(entry.scheduler_output, memo),
                                       copy.deepcopy(entry.requests, memo), entry.scheduled_under,
                                       entry.schedule_span, entry.deferred, future))
        return new
