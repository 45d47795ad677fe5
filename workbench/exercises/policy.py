"""Exercise 2: a scheduling policy -- shortest prompt first -- and the starvation it causes.

The learner writes a :class:`~workbench.core.sched.policies.SchedulingPolicy` subclass (its
``sort_key``: the waiting order, smaller first; ``pick_victim`` is inherited: the running
request the policy would serve last is preempted). The reference is the engine's own
:class:`~workbench.core.sched.policies.ShortestPromptFirstPolicy`: fewest prompt tokens first,
ties by arrival.

The policy is swapped into a real engine (simulated runner, a KV pool tight enough to preempt)
that runs beside one with the reference; after every step the grader compares the two batches
(which request ran, how many tokens) and the preemptions, and checks the engine's invariants.
:func:`starvation` then measures what the policy does to long prompts on a larger workload.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
from hypothesis import strategies as st

from workbench.core.sched.policies import SchedulingPolicy, ShortestPromptFirstPolicy, get_policy
from workbench.exercises.grader import CheckResult, Mismatch, call_solution, first_failure, side_by_side, sim_engine
from workbench.lab.sim import simulate
from workbench.lab.workload import Workload
from workbench.sampling_params import SamplingParams

BLOCK_SIZE = 2


@dataclass(frozen=True)
class PolicyWorkload:
    """Requests ``(request_id, arrival_step, prompt_len, max_tokens)`` on an engine with
    ``num_blocks`` KV blocks of :data:`BLOCK_SIZE` tokens and the two limits."""

    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    requests: tuple[tuple[str, int, int, int], ...]

    def __str__(self) -> str:
        reqs = ", ".join(f"{rid}(arrives step {a}, prompt {p}, max_tokens {m})" for rid, a, p, m in self.requests)
        return (f"num_blocks={self.num_blocks} of {BLOCK_SIZE} tokens, max_num_batched_tokens="
                f"{self.max_num_batched_tokens}, max_num_seqs={self.max_num_seqs}, requests: {reqs}")


@st.composite
def policy_workloads(draw) -> PolicyWorkload:
    """Prompt lengths with ties, arrivals over a few steps, a pool with little to spare."""
    n = draw(st.integers(2, 7))
    requests = tuple((f"r{i}", draw(st.integers(0, 4)), draw(st.sampled_from([1, 2, 3, 5, 8])), draw(st.integers(1, 6)))
                     for i in range(n))
    need = max(-(-(p + m - 1) // BLOCK_SIZE) for _, _, p, m in requests)
    return PolicyWorkload(need + draw(st.integers(0, 3)), draw(st.integers(4, 16)), draw(st.integers(1, 4)), requests)


def as_policy(solution) -> SchedulingPolicy:
    """A policy object from a class or an instance; TypeError naming what is expected."""
    policy = solution() if isinstance(solution, type) else solution
    if not isinstance(policy, SchedulingPolicy):
        raise TypeError(f"the solution must be a SchedulingPolicy subclass or instance, got {solution!r}.")
    return policy


def _engine(workload: PolicyWorkload, policy):
    return sim_engine(block_size=BLOCK_SIZE, num_kv_blocks=workload.num_blocks, policy=policy,
                      max_num_seqs=workload.max_num_seqs, max_num_batched_tokens=workload.max_num_batched_tokens,
                      enable_prefix_caching=False)


def _decision(engine) -> tuple[dict[str, int], tuple[str, ...]]:
    out = engine.history[-1].scheduler_output
    return {c.request_id: c.num_new_tokens for c in out.scheduled}, out.preempted_request_ids


_REFERENCE = ShortestPromptFirstPolicy()


def run_policy(workload: PolicyWorkload, solution: SchedulingPolicy):
    """Run the workload on an engine with the solution's policy and one with the reference,
    in lockstep; Mismatch at the first step whose batch or preemptions differ."""
    ref = _engine(workload, _REFERENCE)
    mine = _engine(workload, solution)
    pending = sorted(workload.requests, key=lambda r: r[1])
    step = 0
    while pending or ref.has_unfinished_requests():
        while pending and (pending[0][1] <= step or not ref.has_unfinished_requests()):
            rid, _, prompt_len, max_tokens = pending.pop(0)
            for engine in (ref, mine):
                call_solution(step, engine.add_request, rid, [7] * prompt_len,
                              SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False))
        queues = {name: [(r.request_id, r.num_prompt_tokens, r.num_tokens) for r in e.scheduler.waiting]
                  for name, e in (("engine", ref), ("yours", mine))}
        ref.step()
        call_solution(step, mine.step)
        try:
            mine.scheduler.check_invariants()
        except AssertionError as exc:
            raise Mismatch(step, f"step {step}: with your policy the engine's invariants broke: {exc}") from None
        expected, got = _decision(ref), _decision(mine)
        if expected != got:
            raise Mismatch(step, _explain(step, expected, got, queues), expected, got, _view(mine, step, expected, got))
        step += 1
    return mine


def _explain(step, expected, got, queues) -> str:
    fmt = lambda b: ", ".join(f"{rid}:{n}" for rid, n in b.items()) or "nothing"  # noqa: E731
    order = lambda q: ", ".join(f"{rid} (prompt {p}{'' if t == p else f', {t} tokens'})" for rid, p, t in q)  # noqa: E731
    lines = [f"step {step}: with your policy the engine's step differs from shortest-prompt-first.",
             f"  shortest-prompt-first ran {fmt(expected[0])}; yours ran {fmt(got[0])}."]
    if expected[1] != got[1]:
        lines.append(f"  Preempted: shortest-prompt-first {list(expected[1]) or 'nobody'}, yours {list(got[1]) or 'nobody'} "
                     "(the victim is the running request the policy would serve last).")
    lines.append(f"  Waiting queue before the step, in serving order: shortest-prompt-first [{order(queues['engine'])}], "
                 f"yours [{order(queues['yours'])}].")
    return "\n".join(lines)


def _view(engine, step, expected, got):
    def make():
        from workbench.viz.player import StepPlayer

        player = StepPlayer(engine, controls=False, live_updates=False)
        player.show(step)
        ids = sorted(set(expected[0]) | set(got[0]) | set(expected[1]) | set(got[1]))
        rows = [(rid, _cell(rid, expected), _cell(rid, got)) for rid in ids]
        return side_by_side(f"step {step}: shortest-prompt-first (left) and your policy (the player)", rows, player)

    return make


def _cell(rid, decision) -> str:
    batch, preempted = decision
    return "preempted" if rid in preempted else str(batch.get(rid, "-"))


def starvation(policies: dict, *, num_requests: int = 30, seed: int = 0) -> pd.DataFrame:
    """What each policy (name -> a policy name, class or instance) does to time to first token
    on one overloaded workload (prompts of 4 to 96 tokens arriving faster than the engine
    serves them; simulated, counted in steps): the mean and p90 over all requests, and the mean
    and worst over the quarter with the longest prompts -- the ones shortest-prompt-first starves."""
    workload = Workload.poisson(num_requests=num_requests, rate=2.0, input_len=(4, 96), output_len=(4, 12), seed=seed)
    rows = {}
    for name, policy in policies.items():
        policy = get_policy(policy) if isinstance(policy, str) else as_policy(policy)
        run = simulate(workload, dict(policy=policy, max_num_seqs=4, max_num_batched_tokens=48, num_kv_blocks=64,
                                      block_size=16))
        df = run.requests
        longest = df[df.num_prompt_tokens >= df.num_prompt_tokens.quantile(0.75)]
        rows[name] = {"mean TTFT": df.ttft_steps.mean(), "p90 TTFT": df.ttft_steps.quantile(0.9),
                      "longest prompts: mean TTFT": longest.ttft_steps.mean(),
                      "longest prompts: worst TTFT": longest.ttft_steps.max()}
    return pd.DataFrame.from_dict(rows, orient="index").round(1)


def check_policy(solution, *, workloads: Sequence[PolicyWorkload] | None = None, max_examples: int = 60,
                 hints=()) -> CheckResult:
    """Grade a shortest-prompt-first policy (see module docstring)."""
    try:
        solution = as_policy(solution)
    except Exception as exc:  # the learner's class cannot be made: step 0's feedback
        return CheckResult("policy", False, f"step 0: your policy could not be made: {type(exc).__name__}: {exc}",
                           0, hints=hints)
    found = first_failure(policy_workloads(), lambda w: run_policy(w, solution), max_examples=max_examples,
                          workloads=workloads)
    if found is None:
        count = max_examples if workloads is None else len(workloads)
        return CheckResult("policy", True, f"with your policy every step equals shortest-prompt-first's in {count} "
                           "workloads. Measure its starvation: workbench.exercises.policy.starvation(...).",
                           score=f"{count}/{count} workloads")
    workload, m = found
    label = "Smallest workload found" if workloads is None else "Workload"
    return CheckResult("policy", False, f"{m.message}\n  {label}: {workload}", m.step, m.expected, m.got, workload,
                       hints=hints, view=m.view)
