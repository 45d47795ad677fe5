"""Exercises 1 and 4: one step's batch of a continuous-batching scheduler.

The learner writes ``schedule(running, waiting, max_num_batched_tokens, max_num_seqs)``: given
the queues as :class:`RequestView` s (running in their order, waiting in serving order), return
the step's batch as ``[(request_id, num_new_tokens), ...]``. The rule is vLLM v1's (the
engine's :class:`~workbench.core.sched.scheduler.Scheduler`, with KV blocks to spare):

* running requests first, in order, each ``min(num_tokens - num_computed_tokens, budget left)``
  tokens, while budget is left;
* then waiting requests in order, while budget is left and fewer than ``max_num_seqs`` requests
  run; with chunked prefill off (exercise 1, ``admission``) a request is admitted only if all
  its tokens fit what is left, and the first that does not fit stops the pass; with it on
  (exercise 4, ``chunked_prefill``) it gets ``min(its tokens, budget left)`` -- a long
  prompt is split over steps, and a running request part-way through its prompt continues.

The grader steps the engine on the simulated runner. Before each step it hands the solution
the queues as the scheduler sees them, then compares the solution's batch with the batch the
scheduler makes (which request ran, how many tokens each) and checks the engine's invariants.
Up to the first difference the solution's batches are the engine's, so the run is the one
the solution would have driven.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hypothesis import strategies as st

from workbench.core.kv_cache_manager import KVCacheManager
from workbench.core.sched.scheduler import Scheduler
from workbench.exercises.grader import (MAX_MODEL_LEN, CheckResult, Mismatch, call_solution, first_failure, side_by_side,
                                       sim_engine)
from workbench.request import Request, RequestStatus
from workbench.sampling_params import SamplingParams

Batch = list[tuple[str, int]]
MAX_REQUESTS = 6  # in a drawn workload


@dataclass(frozen=True)
class RequestView:
    """A request as the scheduler sees it: prompt length, known tokens (prompt + generated)
    and how many of them have K/V computed. A waiting request has ``num_computed_tokens == 0``."""

    request_id: str
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int


@dataclass(frozen=True)
class BatchWorkload:
    """Requests ``(request_id, arrival_step, prompt_len, max_tokens)`` and the two limits.
    A request arrives before engine step ``arrival_step`` (sooner when the engine is idle)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    requests: tuple[tuple[str, int, int, int], ...]

    def __str__(self) -> str:
        reqs = ", ".join(f"{rid}(arrives step {a}, prompt {p}, max_tokens {m})" for rid, a, p, m in self.requests)
        return (f"max_num_batched_tokens={self.max_num_batched_tokens}, max_num_seqs={self.max_num_seqs}, "
                f"requests: {reqs}")


def batch_workloads(chunked: bool) -> st.SearchStrategy[BatchWorkload]:
    """Small workloads; with chunked prefill off every prompt fits one step's budget (the
    engine refuses longer ones), with it on prompts reach three budgets."""

    @st.composite
    def draw(draw) -> BatchWorkload:
        budget = draw(st.integers(2, 16))
        max_num_seqs = draw(st.integers(1, 4))
        n = draw(st.integers(1, MAX_REQUESTS))
        longest = 3 * budget if chunked else budget
        requests = tuple((f"r{i}", draw(st.integers(0, 4)), draw(st.integers(1, longest)), draw(st.integers(1, 4)))
                         for i in range(n))
        return BatchWorkload(budget, max_num_seqs, requests)

    return draw()


def engine_schedule(running: Sequence[RequestView], waiting: Sequence[RequestView], max_num_batched_tokens: int,
                    max_num_seqs: int, *, enable_chunked_prefill: bool) -> Batch:
    """The engine's own ``Scheduler.schedule()`` on these queues (a KV pool with room for
    every request, prefix caching off): the reference, in the stub's shape."""
    views = [*running, *waiting]
    longest = max((v.num_tokens for v in views), default=1)
    block_size = 16
    kv = KVCacheManager(num_blocks=(longest // block_size + 1) * max(1, len(views)), block_size=block_size,
                        enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=longest + 2, enable_chunked_prefill=enable_chunked_prefill)
    for v in running:
        request = _request(v)
        kv.allocate_slots(request, v.num_computed_tokens)
        request.status, request.num_computed_tokens = RequestStatus.RUNNING, v.num_computed_tokens
        scheduler.requests[v.request_id] = request
        scheduler.running.append(request)
    for v in waiting:
        scheduler.add_request(_request(v))
    return [(c.request_id, c.num_new_tokens) for c in scheduler.schedule().scheduled]


def _request(view: RequestView) -> Request:
    return Request(view.request_id, [0] * view.num_prompt_tokens, SamplingParams(max_tokens=1 << 20, ignore_eos=True),
                   output_token_ids=[0] * (view.num_tokens - view.num_prompt_tokens))


def admission_reference(running, waiting, max_num_batched_tokens, max_num_seqs) -> Batch:
    """Exercise 1's reference: the engine's scheduler with chunked prefill off."""
    return engine_schedule(running, waiting, max_num_batched_tokens, max_num_seqs, enable_chunked_prefill=False)


def chunked_prefill_reference(running, waiting, max_num_batched_tokens, max_num_seqs) -> Batch:
    """Exercise 4's reference: the engine's scheduler with chunked prefill on."""
    return engine_schedule(running, waiting, max_num_batched_tokens, max_num_seqs, enable_chunked_prefill=True)


def _views(requests) -> list[RequestView]:
    return [RequestView(r.request_id, r.num_prompt_tokens, r.num_tokens, r.num_computed_tokens) for r in requests]


def _as_batch(step: int, got) -> dict[str, int]:
    """The solution's answer as {request_id: tokens}, or a Mismatch naming what is malformed."""
    try:
        pairs = [(rid, n) for rid, n in got]
    except (TypeError, ValueError):
        raise Mismatch(step, f"step {step}: schedule() must return a list of (request_id, num_new_tokens) "
                             f"pairs, got {got!r}.") from None
    batch: dict[str, int] = {}
    for rid, n in pairs:
        if rid in batch:
            raise Mismatch(step, f"step {step}: your batch names {rid!r} twice: {pairs}.")
        if not isinstance(n, int) or n < 1:
            raise Mismatch(step, f"step {step}: your batch gives {rid!r} {n!r} tokens; a scheduled request "
                                 f"gets an integer >= 1 (leave out the ones that do not run).")
        batch[rid] = n
    return batch


def explain(step: int, expected: Batch, got: dict[str, int], running: list[RequestView],
            waiting: list[RequestView], budget: int, max_num_seqs: int) -> str:
    """What differs between the engine's batch and the solution's, and the rule it breaks."""
    views = {v.request_id: v for v in [*running, *waiting]}
    ref = dict(expected)
    fmt = lambda b: ", ".join(f"{rid}:{n}" for rid, n in b.items()) or "nothing"  # noqa: E731
    lines = [f"step {step}: your batch differs from the engine's.",
             f"  engine: {fmt(ref)}  ({sum(ref.values())} of max_num_batched_tokens={budget} tokens)",
             f"  yours:  {fmt(got)}  ({sum(got.values())} tokens)"]
    if sum(got.values()) > budget:
        lines.append(f"  Yours uses {sum(got.values())} tokens > max_num_batched_tokens={budget}.")
    num_running = len(running) + sum(1 for rid in got if rid not in {v.request_id for v in running})
    if num_running > max_num_seqs:
        lines.append(f"  Yours would have {num_running} requests running > max_num_seqs={max_num_seqs} "
                     f"({len(running)} were running already).")
    left = budget
    for rid, n in expected:  # the budget left when the engine reached each request it scheduled
        if got.get(rid) != n:
            v = views[rid]
            queue = "running" if v in running else "waiting"
            lines.append(f"  First difference: {queue} request {rid} ({v.num_tokens - v.num_computed_tokens} "
                         f"to compute, {v.num_computed_tokens} computed): the engine gives it {n} with "
                         f"{left} of the budget left, yours {got.get(rid, 0)}.")
            break
        left -= n
    else:
        extra = next(rid for rid in got if rid not in ref)
        v = views.get(extra)
        where = "unknown" if v is None else ("running" if v in running else "waiting")
        lines.append(f"  First difference: yours schedules {where} request {extra} (gives it {got[extra]}), "
                     f"the engine does not (it had {left} of the budget left after its batch).")
    return "\n".join(lines)


def run_batches(workload: BatchWorkload, solution: Callable, enable_chunked_prefill: bool):
    """Step the engine over ``workload`` asking ``solution`` at each step; Mismatch at the
    first difference. Returns the engine (its history holds every step)."""
    budget, max_num_seqs = workload.max_num_batched_tokens, workload.max_num_seqs
    engine = sim_engine(block_size=4, num_kv_blocks=MAX_MODEL_LEN // 4 * MAX_REQUESTS,  # room for all: no preemption
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        enable_chunked_prefill=enable_chunked_prefill, enable_prefix_caching=False)
    pending = sorted(workload.requests, key=lambda r: r[1])
    params = lambda m: SamplingParams(max_tokens=m, ignore_eos=True, detokenize=False)  # noqa: E731
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and (pending[0][1] <= step or not engine.has_unfinished_requests()):
            rid, _, prompt_len, max_tokens = pending.pop(0)
            engine.add_request(rid, [7] * prompt_len, params(max_tokens))
        scheduler = engine.scheduler
        running, waiting = _views(scheduler.running), _views(scheduler.waiting)
        got = _as_batch(step, call_solution(step, solution, list(running), list(waiting), budget, max_num_seqs))
        engine.step()
        scheduler.check_invariants()
        expected = [(c.request_id, c.num_new_tokens) for c in engine.history[-1].scheduler_output.scheduled]
        if got != dict(expected):
            message = explain(step, expected, got, running, waiting, budget, max_num_seqs)
            view = _view(engine, step, expected, got, running, waiting)
            raise Mismatch(step, message, expected, sorted(got.items()), view)
        step += 1
    return engine


def _view(engine, step, expected, got, running, waiting):
    def make():
        from workbench.viz.player import StepPlayer

        player = StepPlayer(engine, controls=False, live_updates=False)
        player.show(step)
        ref = dict(expected)
        rows = [(f"{v.request_id} ({'running' if v in running else 'waiting'}, "
                 f"{v.num_computed_tokens}/{v.num_tokens} computed)", str(ref.get(v.request_id, "-")),
                 str(got.get(v.request_id, "-"))) for v in [*running, *waiting]]
        return side_by_side(f"step {step}: tokens per request", rows, player)

    return make


def check_batches(name: str, solution: Callable, enable_chunked_prefill: bool, *,
                  workloads: Sequence[BatchWorkload] | None = None, max_examples: int = 60, hints=()) -> CheckResult:
    """Grade a ``schedule()`` solution (see module docstring) on hypothesis-drawn workloads,
    or on ``workloads`` when given."""
    found = first_failure(batch_workloads(enable_chunked_prefill),
                          lambda w: run_batches(w, solution, enable_chunked_prefill),
                          max_examples=max_examples, workloads=workloads)
    if found is None:
        count = max_examples if workloads is None else len(workloads)
        return CheckResult(name, True, f"your batches equal the engine's at every step of {count} workloads.",
                           score=f"{count}/{count} workloads")
    workload, m = found
    label = "Smallest workload found" if workloads is None else "Workload"
    return CheckResult(name, False, f"{m.message}\n  {label}: {workload}", m.step, m.expected,
                       m.got, workload, hints=hints, view=m.view)
