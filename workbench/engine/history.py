"""StepRecord and StepHistory: what each engine step scheduled and why, kept for inspection.

A record also keeps the KV block events and request events since the previous record, so
the history can rebuild the block pool as it was after any kept step
(:meth:`StepHistory.kv_state`) and tell each request's story (:meth:`StepHistory.request_log`).
"""

from __future__ import annotations

import copy
import html
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from workbench.core.kv_cache_manager import KVCacheManager
from workbench.core.kv_events import BlockFreed, KVEvent
from workbench.core.kv_state import KVReplay, KVState
from workbench.core.request_events import RequestEvent
from workbench.core.sched.output import SchedulerOutput, SpecDecodeResult
from workbench.engine.batch_queue import StepOverlap
from workbench.metrics.perfetto import write_trace
from workbench.metrics.stats import IterationStats, SchedulerStats
from workbench.structured_output.manager import StructuredOutputStep
from workbench.utils.frozen import FrozenDict

#: The stages of a step whose wall time a StepRecord keeps (seconds); together they are
#: ``LLMEngine.step()`` up to its record. ``propose``: the speculative proposer's drafts for the
#: next step (0 without speculative decoding). ``record``: building this record and its stats.
#: The record's observers (history, stat loggers, tracer, ``on_step`` hooks) run after it is
#: complete: their time is in the next record's ``driver`` entry, with the caller's own work
#: between the two steps.
TIMING_STAGES = ("schedule", "prepare", "forward", "sample", "output", "propose", "record")


class StageTimer:
    """Times a step's stages (``time.perf_counter``): each ``lap(stage)`` is the time since
    the previous lap; ``add`` takes stages timed elsewhere (the runner's) and restarts the lap.
    ``previous_end``: when the step before ended with work left (None: after idle, or the
    first step), which makes the ``driver`` entry."""

    def __init__(self, previous_end: float | None) -> None:
        self._last = time.perf_counter()
        self.timings: dict[str, float] = {} if previous_end is None else {"driver": self._last - previous_end}

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.timings[stage] = now - self._last
        self._last = now

    def add(self, timings: dict[str, float]) -> None:
        self.timings.update(timings)
        self._last = time.perf_counter()


@dataclass(frozen=True)
class StepRecord:
    """One ``LLMEngine.step()``: the batch the scheduler chose, its effects, and timings.

    ``scheduler_output`` is the immutable per-step batch; ``batch`` the packed model inputs
    (None when nothing ran); ``scheduler_stats`` the step's one
    :class:`~workbench.metrics.stats.SchedulerStats`, which ``num_running``, ``num_waiting``,
    ``num_free_blocks``, ``kv_usage`` and ``num_blocks_freed`` read: the state *after* the step. Timings are wall
    seconds and are left out of the plain repr so that it stays deterministic.
    A record is complete when it is made and never changes after (its mappings are
    read-only): the history, the stat loggers, the tracer and the ``on_step`` hooks all see it.
    ``kv_events`` and ``request_events`` are those since the previous record (changes made
    between steps, such as aborts, included), oldest first. ``structured_output``: who waited
    in WAITING_FOR_FSM, grammars compiled, and per constrained row the allowed-token count and
    forced token (empty without constrained requests).
    """

    step: int
    scheduler_output: SchedulerOutput
    batch: object | None
    sampled_token_ids: dict[str, int]
    finished_request_ids: tuple[str, ...]
    scheduler_stats: SchedulerStats = field(default_factory=SchedulerStats)
    timings: dict[str, float] = field(default_factory=dict)
    kv_events: tuple[KVEvent, ...] = ()
    request_events: tuple[RequestEvent, ...] = ()
    structured_output: StructuredOutputStep = field(default_factory=StructuredOutputStep)
    #: Speculative decoding: per speculating request, the drafts it verified this step and
    #: how many the target accepted (``SpecDecodeResult``); empty without speculation.
    spec_decode: dict[str, SpecDecodeResult] = field(default_factory=dict)
    #: The KV connector's output (``KVConnectorOutput``: transfers started, sends and
    #: receives finished) this step; None without a connector.
    kv_connector_output: object = None
    #: What the stat loggers were fed for this step (wall-clock latencies: not compared).
    iteration_stats: IterationStats | None = field(default=None, compare=False, repr=False)
    #: Async scheduling: what this step's host work ran under, its placeholders, what it
    #: deferred and dropped (:class:`~workbench.engine.batch_queue.StepOverlap`); None: synchronous.
    overlap: StepOverlap | None = None

    def __post_init__(self) -> None:
        """The record's own mappings become read-only: observers share one record."""
        for name in ("sampled_token_ids", "timings", "spec_decode"):
            value = getattr(self, name)
            if type(value) is not FrozenDict:
                object.__setattr__(self, name, FrozenDict(value))

    @property
    def reasons(self) -> FrozenDict:
        """Request id -> why it was not (fully) scheduled this step (``core.sched.explain``)."""
        why = self.scheduler_output.explanation
        return why.reasons if why is not None else FrozenDict()

    @property
    def preemptions(self) -> tuple:
        """This step's preemptions, explained (``PreemptionExplanation``s)."""
        why = self.scheduler_output.explanation
        return why.preemptions if why is not None else ()

    @property
    def prefix_lookups(self) -> tuple:
        """This step's admissions' prefix lookups, explained (``PrefixLookup``s)."""
        why = self.scheduler_output.explanation
        return why.prefix_lookups if why is not None else ()

    @property
    def num_running(self) -> int:
        return self.scheduler_stats.num_running_reqs

    @property
    def num_waiting(self) -> int:
        return self.scheduler_stats.num_waiting_reqs

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler_stats.num_free_blocks

    @property
    def kv_usage(self) -> float:
        return self.scheduler_stats.kv_cache_usage

    @property
    def num_blocks_freed(self) -> int:
        return self.scheduler_stats.num_blocks_freed

    @property
    def num_scheduled_tokens(self) -> int:
        return self.scheduler_output.total_num_scheduled_tokens

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduler_output.scheduled if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_scheduled_tokens - self.num_prefill_tokens

    def to_row(self) -> dict:
        so = self.scheduler_output
        row = {
            "step": self.step,
            "num_seqs": len(so.scheduled),
            "num_tokens": self.num_scheduled_tokens,
            "prefill_tokens": self.num_prefill_tokens,
            "decode_tokens": self.num_decode_tokens,
            "token_budget": so.token_budget,
            "new": len(so.new_request_ids),
            "resumed": len(so.resumed_request_ids),
            "preempted": len(so.preempted_request_ids),
            "finished": len(self.finished_request_ids),
            "running": self.num_running,
            "waiting": self.num_waiting,
            "blocks_allocated": so.num_blocks_allocated,
            "blocks_freed": self.num_blocks_freed,
            "blocks_evicted": so.num_blocks_evicted,
            "prefix_hit_tokens": so.num_prefix_cache_hit_tokens,
            "free_blocks": self.num_free_blocks,
            "kv_usage": self.kv_usage,
        }
        row.update({f"t_{k}": self.timings.get(k, 0.0) for k in TIMING_STAGES})
        return row

    def __repr__(self) -> str:
        so = self.scheduler_output
        chunks = ", ".join(
            f"{s.request_id}:{'P' if s.is_prefill else 'D'}{s.num_new_tokens}" for s in so.scheduled
        )
        extra = []
        for name, ids in (
            ("new", so.new_request_ids),
            ("resumed", so.resumed_request_ids),
            ("preempted", so.preempted_request_ids),
            ("finished", self.finished_request_ids),
        ):
            if ids:
                extra.append(f"{name}={list(ids)}")
        if self.spec_decode:  # accepted / drafted tokens per speculating request
            extra.append("spec={" + ", ".join(f"{rid}: {r.num_accepted}/{r.num_draft_tokens}"
                                              for rid, r in self.spec_decode.items()) + "}")
        grammar = self.structured_output
        if grammar.waiting_for_fsm:
            extra.append(f"waiting_for_fsm={list(grammar.waiting_for_fsm)}")
        if grammar.rows:  # allowed-token count per constrained row, "!token" when forced
            extra.append("grammar={" + ", ".join(
                f"{rid}: {row.num_allowed}" + ("" if row.forced_token is None
                                               else f"!{row.forced_token}")
                for rid, row in grammar.rows.items()) + "}")
        return (
            f"StepRecord(step={self.step}, tokens={self.num_scheduled_tokens}/{so.token_budget}, "
            f"[{chunks}]{', ' if extra else ''}{', '.join(extra)}, "
            f"running={self.num_running}, waiting={self.num_waiting}, "
            f"kv_usage={self.kv_usage:.2f})"
        )

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(s.request_id)}</td>"
            f"<td>{'prefill' if s.is_prefill else 'decode'}</td>"
            f"<td>{s.num_computed_tokens}</td><td>{s.num_new_tokens}</td>"
            f"<td>{s.num_cached_tokens}</td><td>{list(s.block_ids)}</td>"
            f"<td>{self.sampled_token_ids.get(s.request_id, '')}{self._grammar_cell(s.request_id)}"
            "</td></tr>"
            for s in self.scheduler_output.scheduled
        )
        waiting = self.structured_output.waiting_for_fsm
        if waiting:
            rows += (f'<tr><td colspan="7">waiting for their grammar (WAITING_FOR_FSM): '
                     f"{html.escape(', '.join(waiting))}</td></tr>")
        return (
            f"<b>Step {self.step}</b>: {self.num_scheduled_tokens} tokens, "
            f"{self.num_running} running, {self.num_waiting} waiting, "
            f"KV usage {self.kv_usage:.0%}"
            "<table><tr><th>request</th><th>kind</th><th>computed</th><th>new tokens</th>"
            "<th>cached</th><th>block table</th><th>sampled</th></tr>" + rows + "</table>"
        )


    def _grammar_cell(self, request_id: str) -> str:
        """The sampled cell's grammar note for a constrained row (empty for a free one)."""
        row = self.structured_output.rows.get(request_id)
        if row is None:
            return ""
        forced = "" if row.forced_token is None else ", forced"
        return f" (grammar: {row.num_allowed} allowed{forced})"


class StepHistory:
    """The last ``maxlen`` StepRecords, oldest first; indexable like a list.

    ``initial_kv_state`` is the pool before the first record (the engine passes a snapshot
    taken at start). When the oldest record is dropped its block events are folded into that
    base state, so :meth:`kv_state` works for every kept step however long the run.

    Invariant: the pool before the oldest kept record is the base (``_base``, or
    ``_base_replay`` rolled forward) followed by the block events in ``_dropped``, which are
    only held while a checkpoint of a kept step exists; when that step's record is dropped,
    its checkpoint becomes the base. An engine appends with its ``kv_cache`` and the history
    captures the live pool as a checkpoint now and then (see :meth:`append`), so a long run
    drops its records without replaying their events (the replay of one dropped record cost
    ~0.5 ms of CPU at 256 running decodes, a quarter of a simulated step).
    """

    #: A rebuilt state is remembered every this many steps (num_blocks // 64 for bigger
    #: pools), so scrubbing back and forth replays few events: on a 5461-block pool with 64
    #: decoding requests, a random step of a 2000-step history takes ~5 ms once the history
    #: was replayed to its end (~0.5 s, the first time).
    CHECKPOINT_EVERY = 32

    def __init__(self, maxlen: int = 10_000, initial_kv_state: KVState | None = None) -> None:
        self._records: deque[StepRecord] = deque(maxlen=maxlen)
        self._base = initial_kv_state  # the pool before the first kept record
        self._base_replay: KVReplay | None = None  # the base, rolled forward by dropped records
        self._checkpoints: dict[int, KVState] = {}  # step -> state after it
        self._last: tuple[int, KVState] | None = None  # the last state asked for
        self._dropped: list[tuple[KVEvent, ...]] = []  # events after the base, before the oldest kept
        self._since_capture = [0, 0]  # records and block events appended since the last live capture

    def __deepcopy__(self, memo: dict) -> StepHistory:
        """A copy (``engine.fork()``) that shares the records and the rebuilt states, which are
        immutable; appending to one never shows in the other."""
        new = copy.copy(self)
        memo[id(self)] = new
        new._records = deque(self._records, maxlen=self._records.maxlen)
        new._checkpoints = dict(self._checkpoints)
        new._base_replay = copy.deepcopy(self._base_replay, memo)
        new._dropped = list(self._dropped)
        new._since_capture = list(self._since_capture)
        return new

    def append(self, record: StepRecord, kv_cache: KVCacheManager | None = None) -> None:
        """Keep ``record`` (the step after the last kept one). ``kv_cache``: the
        KVCacheManager whose events the record holds, as it is right after them (the engine's
        own history); then, once both ``maxlen // 8`` records and as many block events as
        the pool has blocks came since the last capture, its snapshot becomes the record's
        checkpoint: one O(num_blocks) capture in place of replaying those records' events
        when they are dropped, and at most about nine captures kept."""
        if self._records and record.step != self._records[-1].step + 1:
            raise ValueError(
                f"step {record.step} cannot follow step {self._records[-1].step}: records are consecutive."
            )
        if len(self._records) == self._records.maxlen:
            self._drop_oldest()
        self._records.append(record)
        if kv_cache is not None:
            since = self._since_capture
            since[0] += 1
            since[1] += len(record.kv_events)
            if since[0] >= self._records.maxlen // 8 and since[1] >= kv_cache.num_blocks:
                self._checkpoints[record.step] = kv_cache.snapshot()
                since[0] = since[1] = 0

    def clear(self) -> None:
        """Forget every record (their block events stay folded into the base state)."""
        while self._records:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        oldest = self._records.popleft()
        checkpoint = self._checkpoints.pop(oldest.step, None)
        if checkpoint is not None:  # the pool after the dropped record: the new base
            self._base, self._base_replay, self._dropped = checkpoint, None, []
        elif self._checkpoints:  # a later checkpoint will be the base: replay only if asked before
            if oldest.kv_events:
                self._dropped.append(oldest.kv_events)
        elif self._base is not None or self._base_replay is not None:
            if self._base_replay is None:
                self._base_replay = KVReplay(self._base)
            self._base_replay.run(oldest.kv_events)
            self._base = None  # frozen again when asked for
        if self._last is not None and self._last[0] == oldest.step:
            self._last = None

    def _base_state(self) -> KVState:
        if self._dropped and (self._base is not None or self._base_replay is not None):
            if self._base_replay is None:
                self._base_replay = KVReplay(self._base)
            for events in self._dropped:
                self._base_replay.run(events)
            self._base, self._dropped = None, []
        if self._base is None and self._base_replay is not None:
            self._base = self._base_replay.freeze()
        if self._base is None:
            raise ValueError(
                "this history has no starting KV snapshot: it was not recorded by an engine "
                "(StepHistory(initial_kv_state=...) gives one)."
            )
        return self._base

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[StepRecord]:
        return iter(self._records)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self._records)[index]
        return self._records[index]

    @property
    def steps(self) -> range:
        """The step numbers kept, oldest first."""
        if not self._records:
            return range(0)
        return range(self._records[0].step, self._records[-1].step + 1)

    def record(self, step: int) -> StepRecord:
        """The record of step number ``step`` (IndexError naming the kept range if absent)."""
        steps = self.steps
        if step not in steps:
            kept = f"[{steps.start}, {steps.stop - 1}]" if steps else "none"
            raise IndexError(f"step {step} is not recorded (steps kept: {kept}).")
        return self._records[step - steps.start]

    # ------------------------------------------------------------ time travel
    def kv_state(self, step: int | None = None, *, during_forward: bool = False) -> KVState:
        """The KV pool as it was right after step ``step`` (default: the last recorded step),
        rebuilt from the recorded block events. O(events since the nearest checkpoint).

        ``during_forward=True``: the pool as the step's forward pass saw it, after its
        scheduling (prefix hits, new blocks) and before the requests it finished released
        their blocks -- where requests that finish in one step (a beam search's) show the
        blocks they shared (ref_count > 1)."""
        if during_forward:
            record = self.record(self._records[-1].step if step is None else step)
            before = self.kv_state(record.step - 1) if record.step - 1 in self.steps else self._base_state()
            ran = {s.request_id for s in record.scheduler_output.scheduled}
            done = ran.intersection(record.finished_request_ids)
            return before.apply(e for e in record.kv_events
                                if not (isinstance(e, BlockFreed) and e.request_id in done))
        base = self._base_state()
        if step is None:
            if not self._records:
                return base
            step = self._records[-1].step
        target = self.steps.index(self.record(step).step)
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        start, state = 0, base
        for i in range(target, -1, -1):
            checkpoint = self._checkpoints.get(self._records[i].step)
            if checkpoint is not None:
                start, state = i + 1, checkpoint
                break
        if start > target:
            return state
        replay = KVReplay(state)
        every = max(self.CHECKPOINT_EVERY, state.num_blocks // 64)
        for i in range(start, target + 1):
            record = self._records[i]
            replay.run(record.kv_events)
            if record.step % every == every - 1:
                self._checkpoints[record.step] = replay.freeze()
        state = self._checkpoints.get(step) or replay.freeze()
        self._last = (step, state)
        return state

    def request_log(self, request_id: str) -> list[RequestEvent]:
        """The kept events of one request, oldest first."""
        return [e for r in self._records for e in r.request_events if e.request_id == request_id]

    def explain(self, request_id: str, step: int | None = None):
        """Why ``request_id`` waited, ran short or was preempted, over the kept steps (``step``:
        that one): a :class:`~workbench.engine.why.RequestExplanation` (``.table``, ``str()``)."""
        from workbench.engine.why import explain_request

        return explain_request(self._records, request_id, step)

    def to_dataframe(self):
        """One row per step (pandas DataFrame indexed by step)."""
        import pandas as pd

        frame = pd.DataFrame([r.to_row() for r in self._records])
        return frame.set_index("step") if len(frame) else frame

    def to_perfetto(self, path, name: str = "engine"):
        """Write the kept steps as a Chrome trace-event JSON file that ui.perfetto.dev and
        chrome://tracing open (one process ``name``; see :mod:`workbench.metrics.perfetto`)."""
        return write_trace(path, [(name, self)], stages=TIMING_STAGES)

    def __repr__(self) -> str:
        return f"StepHistory({len(self)} steps)"

    def _repr_html_(self) -> str:
        """The last ten steps as a table (``to_dataframe()`` has them all)."""
        frame = self.to_dataframe()
        shown = frame.tail(10).drop(columns=[c for c in frame.columns if c.startswith("t_")])
        return f"<b>StepHistory</b>: {len(self)} steps, the last {len(shown)}:" + shown.to_html()
