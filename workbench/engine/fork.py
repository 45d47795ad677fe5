"""Forks: ``engine.fork()`` (an independent engine in exactly a live engine's state), the
scheduling changes a branch may make from its fork on, and ``first_divergence(a, b)``.

A fork is one ``copy.deepcopy`` of the engine's state, so every object keeps its sharing
(a request is the same object in the scheduler, the KV manager and the output processor).
Its independence holds by construction: the copy's memo is seeded with what a fork shares,
and everything else is copied -- whatever a step or a call writes: the scheduler's queues,
the KV manager (block tables, free queue, prefix cache), the KV tensors, the model's modules
with their LoRA slot tensors and the adapter manager that fills them, the sampler's and the
draft model's state, generators, detokenizers, grammars' matchers, the clock's state.
Shared, and never written by anyone:

* the weights, as each runner declares them (``fork_shared()``: the model's and the draft
  model's parameters and buffers, which no step writes, and the LoRA adapters read into
  host memory; weights a runner does not declare are copied, which costs memory, never
  correctness). The fork gets its own tensor objects over the weights' storage, so
  ``sleep()``, which rebinds an engine's tensors, drops only that engine's references: the
  storage lives on while the other engine holds it;
* the immutable: the tokenizer and the model configs; the compiled grammars and their
  compile thread (:meth:`StructuredOutputManager.__deepcopy__`); the history's records.

Not state but the original's observers, so a fork starts without them: ``on_step`` hooks,
stat loggers (a fresh logging one when ``log_stats``), the tracer and the profiler.
Refused (RuntimeError naming what to do; nothing copied): a sleeping engine (its KV cache is
gone), an engine being profiled (the profiler wraps the engine's own methods), an engine
served by :class:`~workbench.engine.async_llm.AsyncLLM` from any thread but its engine
thread (a step may be under way).

Invariant (``tests/engine/test_fork.py``): an engine and its fork, both left unchanged, step
as a fresh engine given the same inputs does -- every StepRecord field but the wall-clock
``timings``, every token, logprob and text -- and nothing done to one (stepping, adding,
aborting, sleeping, profiling) changes the other.
"""

from __future__ import annotations

import copy
import dataclasses
import html
import sys
import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING

from workbench.core.sched.policies import get_policy
from workbench.core.sched.request_queue import WaitingQueue
from workbench.metrics.stats import LoggingStatLogger

if TYPE_CHECKING:
    from workbench.engine.history import StepRecord

    LLMEngine = object  # an LLMEngine (llm_engine imports this module)

#: The scheduling settings a branch may change from its fork on.
SCHEDULING_CHANGES = ("policy", "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill")
#: Engine attributes that observe it rather than hold its state: a fork starts without them.
OBSERVERS = ("on_step", "stat_loggers", "tracer", "profiler")
#: The thread that alone steps an engine AsyncLLM serves (see :func:`set_engine_thread`).
_engine_threads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def set_engine_thread(engine: LLMEngine, thread: threading.Thread | None) -> None:
    """Record that only ``thread`` steps ``engine`` from now on (AsyncLLM's engine thread), so
    only it may fork the engine, between two steps; None, from that thread: it stopped."""
    if thread is not None:
        _engine_threads[engine] = thread
    elif _engine_threads.get(engine) is threading.current_thread():
        del _engine_threads[engine]


def _own(shared):
    """The fork's own object for a shared one: a tensor over the same storage (a parameter
    stays a parameter), anything else the object itself. No tensor exists before torch is
    imported, and a simulated engine never imports it."""
    torch = sys.modules.get("torch")
    if torch is None:
        return shared
    if isinstance(shared, torch.nn.Parameter):
        return torch.nn.Parameter(shared.data, requires_grad=shared.requires_grad)
    if isinstance(shared, torch.Tensor):
        return shared.detach()
    return shared


def _refuse(engine: LLMEngine) -> None:
    if engine.is_sleeping():
        raise RuntimeError("fork(): the engine is sleeping (its KV cache is gone); wake_up() first.")
    if engine.profiler is not None and engine.profiler.is_running:
        raise RuntimeError("fork(): the engine is being profiled, and the profiler wraps its own methods; "
                           "stop_profile() first, then fork (and start_profile() on either engine).")
    thread = _engine_threads.get(engine)
    if thread is not None and thread is not threading.current_thread():
        raise RuntimeError(f"fork(): the engine is being served (AsyncLLM's thread {thread.name!r} steps it, "
                           "e.g. %llm serve), so a step may be under way. Fork it between two steps on "
                           "that thread, async_llm.submit(engine.fork).result(), or stop serving first "
                           "(%llm stop).")


def fork_engine(engine: LLMEngine) -> LLMEngine:
    """An independent engine in exactly ``engine``'s state (see the module docstring)."""
    _refuse(engine)
    shared = [engine.tokenizer, getattr(engine.tokenizer, "backend_tokenizer", None), engine.model_config]
    for part in (engine.runner, engine.proposer):
        if part is not None:
            shared += part.fork_shared()
    memo: dict = {id(x): _own(x) for x in shared if x is not None}
    state = {k: v for k, v in vars(engine).items() if k not in OBSERVERS}
    fork = object.__new__(type(engine))
    vars(fork).update(copy.deepcopy(state, memo))
    fork.on_step = []
    fork.stat_loggers = {"logging": LoggingStatLogger()} if engine.config.log_stats else {}
    fork.tracer = fork.profiler = None
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

