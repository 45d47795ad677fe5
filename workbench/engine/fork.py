"""Forks: ``engine.fork()`` (an independent engine in exactly a live engine's state), the
scheduling changes a branch may make from its fork on, and ``first_divergence(a, b)``.

A fork is one ``copy.deepcopy`` of the engine's state, so every object keeps its sharing
(a request is the same object in the scheduler, the KV manager and the output processor):
the scheduler's queues and step counter, the KV manager with its block tables, free queue
and prefix cache, the KV tensors, the sampler's generators (each seeded request's, and the
shared one unseeded rows draw from), the detokenizers, the request tracker, the clock's state
(a simulated clock is copied), and the history (its records are immutable, so both engines
hold the same record objects). Shared, not copied: the model weights (read-only), the
tokenizer and the model config. Each structured-output grammar becomes a new matcher over the
same compiled grammar, fed the request's output tokens. Started fresh on the fork: ``on_step``
hooks, stat loggers, the idle waiter; no tracer and no profiler.

Invariant (``tests/engine/test_fork.py``): an engine and its fork, both left unchanged, step
identically -- every StepRecord field but the wall-clock ``timings``, every token, logprob
and text -- and stepping one never changes the other.
"""

from __future__ import annotations

import copy
import dataclasses
import html
from collections.abc import Mapping
from typing import TYPE_CHECKING

from workbench.core.sched.request_queue import get_policy
from workbench.core.sched.scheduler import WaitingQueue
from workbench.engine.idle import IdleWaiter
from workbench.metrics.stats import LoggingStatLogger

if TYPE_CHECKING:
    from workbench.engine.history import StepRecord

    LLMEngine = object  # an LLMEngine (llm_engine imports this module)

#: The scheduling settings a branch may change from its fork on.
SCHEDULING_CHANGES = ("policy", "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill")
#: Engine attributes a fork starts afresh (hooks and loggers belong to the original's observers).
_FRESH = ("on_step", "stat_loggers", "idle", "tracer", "profiler", "structured_output")


def fork_engine(engine: LLMEngine) -> LLMEngine:
    """An independent engine in exactly ``engine``'s state (see the module docstring).
    RuntimeError while it sleeps (its KV cache is gone)."""
    if engine.is_sleeping():
        raise RuntimeError("fork(): the engine is sleeping; wake_up() first.")
    runner = engine.runner
    shared = [engine.tokenizer, getattr(engine.tokenizer, "backend_tokenizer", None),
              engine.model_config, getattr(runner, "model", None), getattr(runner, "model_config", None)]
    memo: dict = {id(x): x for x in shared if x is not None}
    state = {k: v for k, v in vars(engine).items() if k not in _FRESH}
    copied = copy.deepcopy(state, memo)
    fork = object.__new__(type(engine))
    vars(fork).update(copied)
    fork.on_step = []
    fork.stat_loggers = {"logging": LoggingStatLogger()} if engine.config.log_stats else {}
    fork.idle = IdleWaiter(fork.device, engine.config.keep_warm_s)
    fork.tracer = fork.profiler = None
    fork.structured_output = engine.structured_output.fork(memo)
    return fork


def apply_scheduling(engine: LLMEngine, **changes) -> None:
    """Change the engine's scheduling from its next step on: ``policy`` (a name or a
    SchedulingPolicy; the waiting queue is re-ordered by it), ``max_num_batched_tokens``,
    ``max_num_seqs``, ``enable_chunked_prefill``. ``engine.config`` says what it runs now.
    ValueError naming the field for an unknown one or a bad value (nothing changed)."""
    unknown = sorted(set(changes) - set(SCHEDULING_CHANGES))
    if unknown:
        raise ValueError(f"unknown scheduling change(s) {unknown}; known: {list(SCHEDULING_CHANGES)}.")
    changes = {k: v for k, v in changes.items() if v is not None}
    if not changes:
        return
    config = dataclasses.replace(engine.config, **changes)  # validates the values
    scheduler = engine.scheduler
    policy = get_policy(changes.get("policy", scheduler.policy))
    budget = changes.get("max_num_batched_tokens", scheduler.max_num_batched_tokens)
    chunked = changes.get("enable_chunked_prefill", scheduler.enable_chunked_prefill)
    if not chunked:
        too_long = [r.request_id for r in scheduler.requests.values() if r.num_tokens > budget]
        if too_long:
            raise ValueError(f"enable_chunked_prefill=False: request {too_long[0]!r} has more tokens than "
                             f"max_num_batched_tokens={budget} and could never be scheduled again.")
    if policy is not scheduler.policy:
        queue = WaitingQueue(policy)
        for request in scheduler.waiting:  # the old serving order breaks the new key's ties
            queue.add(request)
        scheduler.policy, scheduler.waiting = policy, queue
        engine.input_processor.policy = policy
    scheduler.max_num_batched_tokens = engine.max_num_batched_tokens = budget
    scheduler.max_num_seqs = changes.get("max_num_seqs", scheduler.max_num_seqs)
    scheduler.enable_chunked_prefill = chunked
    engine.config = config


def set_priority(engine: LLMEngine, priorities: Mapping[str, int]) -> None:
    """Give in-flight requests (by the id given to add_request; all of a parent's children) a new
    priority, re-keying the waiting queue. KeyError naming an id not in flight."""
    scheduler = engine.scheduler
    for request_id, priority in priorities.items():
        parent = engine.output_processor.parents.get(request_id)
        if parent is None:
            raise KeyError(f"priority: request {request_id!r} is not in flight.")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority of {request_id!r} must be an integer, got {priority!r}.")
        for child in parent.children:
            child.priority = priority
    queue = WaitingQueue(scheduler.policy)
    for request in scheduler.waiting:
        queue.add(request)
    scheduler.waiting = queue


# ------------------------------------------------------------------ divergence
@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first step at which two runs' batches differ, and how: the requests only one
    scheduled (``only_a``, ``only_b``), ``tokens`` {request: (a's new tokens, b's)} of those both
    scheduled differently, ``preempted`` (a's, b's) when they differ, ``sampled`` {request:
    (a's token, b's)} where both sampled differently; ``ended``: "a" or "b" when that run has
    no such step."""

    step: int
    only_a: tuple[str, ...] = ()
    only_b: tuple[str, ...] = ()
    tokens: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    preempted: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    sampled: Mapping[str, tuple[int | None, int | None]] = dataclasses.field(default_factory=dict)
    ended: str | None = None

    def describe(self) -> list[str]:
        """One line per difference, in words."""
        if self.ended:
            return [f"run {self.ended} has no step {self.step} (it had finished)"]
        lines = []
        if self.only_a:
            lines.append(f"only a scheduled {', '.join(self.only_a)}")
        if self.only_b:
            lines.append(f"only b scheduled {', '.join(self.only_b)}")
        lines += [f"{rid}: {ta} tokens in a, {tb} in b" for rid, (ta, tb) in self.tokens.items()]
        if self.preempted is not None:
            a, b = (", ".join(ids) or "none" for ids in self.preempted)
            lines.append(f"preempted: {a} in a, {b} in b")
        lines += [f"{rid} sampled {ta} in a, {tb} in b" for rid, (ta, tb) in self.sampled.items()]
        return lines or ["the same chunks, scheduled in another order"]

    def __repr__(self) -> str:
        return f"Divergence(step={self.step}: {'; '.join(self.describe())})"

    def _repr_html_(self) -> str:
        items = "".join(f"<li>{html.escape(line)}</li>" for line in self.describe())
        return f"<b>First divergence at step {self.step}</b><ul>{items}</ul>"


def _records(run) -> dict[int, StepRecord]:
    history = getattr(run, "history", run)
    return {r.step: r for r in history}


def step_divergence(step: int, a: StepRecord, b: StepRecord) -> Divergence | None:
    """How step ``step``'s batch differs between records ``a`` and ``b`` (None: the same batch,
    preemptions and sampled tokens)."""
    sa = {s.request_id: s for s in a.scheduler_output.scheduled}
    sb = {s.request_id: s for s in b.scheduler_output.scheduled}
    tokens = {rid: (sa[rid].num_new_tokens, sb[rid].num_new_tokens) for rid in sa
              if rid in sb and (sa[rid].num_new_tokens, sa[rid].num_computed_tokens)
              != (sb[rid].num_new_tokens, sb[rid].num_computed_tokens)}
    pa, pb = a.scheduler_output.preempted_request_ids, b.scheduler_output.preempted_request_ids
    sampled = {rid: (a.sampled_token_ids.get(rid), b.sampled_token_ids.get(rid))
               for rid in a.sampled_token_ids.keys() | b.sampled_token_ids.keys()
               if a.sampled_token_ids.get(rid) != b.sampled_token_ids.get(rid)}
    found = Divergence(step, only_a=tuple(r for r in sa if r not in sb),
                       only_b=tuple(r for r in sb if r not in sa), tokens=tokens,
                       preempted=(pa, pb) if pa != pb else None, sampled=dict(sorted(sampled.items())))
    if found.only_a or found.only_b or tokens or found.preempted or sampled or list(sa) != list(sb):
        return found
    return None


def first_divergence(a, b) -> Divergence | None:
    """The first step whose batch differs between runs ``a`` and ``b`` (RunResults, StepHistories
    or lists of StepRecords), or where one has a step the other has not; None when every step
    is the same (see :func:`step_divergence`)."""
    ra, rb = _records(a), _records(b)
    for step in sorted(ra.keys() | rb.keys()):
        if step not in ra or step not in rb:
            return Divergence(step, ended="a" if step not in ra else "b")
        found = step_divergence(step, ra[step], rb[step])
        if found is not None:
            return found
    return None

