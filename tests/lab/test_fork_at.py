"""run.fork_at(step, ...): branches of a recorded run, and first_divergence.

An unchanged branch repeats its run bitwise (every StepRecord field but the wall-clock timings,
every token and logprob); a changed one keeps every step before its fork and differs from the
fork step on; the edits (abort, add, priority) do what they say; a simulated run forks alike.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workbench import SamplingParams, compare_branches, first_divergence, teaching_config
from workbench.core.sched.output import SchedulerOutput, ScheduledRequest
from workbench.engine.fork import Divergence
from workbench.engine.history import StepRecord
from workbench.lab.compare import run_workload
from workbench.lab.sim import CostModel, simulate
from workbench.lab.workload import Workload, WorkloadRequest

TEN_MS = CostModel({"step": 0.010})
CFG = teaching_config(num_kv_blocks=12, enable_prefix_caching=True)


def _req(rid, prompt, max_tokens, step, **params):
    params = {"temperature": 0.0, "ignore_eos": True, **params}
    return WorkloadRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, **params), arrival_step=step)


SHARED = list(range(11, 19))  # two full blocks of 4: prefix hits
WORKLOAD = Workload([
    _req("a", SHARED + [30, 31, 32], 10, 0, temperature=1.0, logprobs=1),  # unseeded
    _req("b", SHARED + [40] * 5, 10, 0, temperature=1.0, seed=5, logprobs=1),  # seeded
    _req("c", SHARED + [50, 51], 8, 1),
    _req("d", [60 + i for i in range(14)], 8, 2, temperature=0.7),
])


def same_records(a, b, steps) -> None:
    ra, rb = {r.step: r for r in a.history}, {r.step: r for r in b.history}
    for step in steps:
        x, y = ra[step], rb[step]
        for f in dataclasses.fields(x):
            u, v = getattr(x, f.name), getattr(y, f.name)
            if f.name == "timings" or not f.compare:  # wall clock
                continue
            if f.name == "batch" and u is not None:
                assert all(torch.equal(getattr(u, g.name), getattr(v, g.name)) if isinstance(getattr(u, g.name), torch.Tensor)
                           else getattr(u, g.name) == getattr(v, g.name) for g in dataclasses.fields(u)), step
            else:
                assert u == v, (step, f.name)


def outputs(run) -> dict:
    return {rid: (o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].text) for rid, o in run.outputs.items()}


@pytest.fixture(scope="module")
def real():
    run = run_workload(WORKLOAD, CFG)
    assert run.summary()["num_preemptions"] > 0 and run.prefix_hits > 0  # the cases are there
    return run


def first_preemption(run) -> int:
    return next(r.step for r in run.history if r.scheduler_output.preempted_request_ids)


def test_an_unchanged_branch_of_a_real_run_is_bitwise_the_run(real):
    k = first_preemption(real)
    same = real.fork_at(k)
    assert same.fork_step == k and same.branch == f"from step {k}: nothing changed"
    assert first_divergence(real, same) is None
    same_records(real, same, range(real.num_steps))
    assert outputs(same) == outputs(real) and len(outputs(real)) == 4


def test_another_policy_differs_from_the_fork_step_never_before(real):
    k = first_preemption(real)
    spf = real.fork_at(k, policy="spf")
    found = first_divergence(real, spf)
    assert found is not None and found.step >= k
    same_records(real, spf, range(k))
    assert spf.config.policy == "spf" and spf.policy == "spf" and real.config.policy == "fcfs"
    # the fork keeps each request's sampling stream: a request whose schedule did not change up to
    # its end has the same tokens in both branches
    cmp = compare_branches(real, {"spf": spf})
    assert cmp.fork_step == k and list(cmp.results) == ["original", "spf"]
    table = cmp.per_request()
    assert list(table.columns) == [("ttft_steps", "original"), ("ttft_steps", "spf"),
                                   ("e2e_steps", "original"), ("e2e_steps", "spf")]
    assert table.loc["a", ("e2e_steps", "original")] == real.requests.set_index("request_id").loc["a", "e2e_steps"]


def _record(step, chunks, preempted=(), sampled=None):
    scheduled = tuple(ScheduledRequest(rid, c, n, tuple(range(n)), (0,), c == 0, True) for rid, c, n in chunks)
    return StepRecord(step, SchedulerOutput(step, scheduled, preempted_request_ids=tuple(preempted)), None,
                      dict(sampled or {rid: 7 for rid, _, _ in chunks}), ())


def test_first_divergence_on_a_hand_made_pair():
    a = [_record(0, [("x", 0, 4), ("y", 0, 4)]), _record(1, [("x", 4, 1), ("y", 4, 1)]),
         _record(2, [("x", 5, 1)], preempted=["y"]), _record(3, [("x", 6, 1)])]
    b = [_record(0, [("x", 0, 4), ("y", 0, 4)]), _record(1, [("x", 4, 1), ("y", 4, 1)]),
         _record(2, [("x", 5, 1), ("y", 5, 1), ("z", 0, 6)], sampled={"x": 8, "y": 7, "z": 7})]
    found = first_divergence(a, b)
    assert found == Divergence(2, only_a=(), only_b=("y", "z"), tokens={}, preempted=(("y",), ()),
                               sampled={"x": (7, 8), "y": (None, 7), "z": (None, 7)})
    assert repr(found) == ("Divergence(step=2: only b scheduled y, z; preempted: y in a, none in b; "
                           "x sampled 7 in a, 8 in b; y sampled None in a, 7 in b; z sampled None in a, 7 in b)")
    assert first_divergence(a[:2], b[:2]) is None
    assert first_divergence(a[:2], b[:3]) == Divergence(2, ended="a")
    c = a[:1] + [_record(1, [("x", 4, 1), ("y", 4, 2)])]
    assert first_divergence(a, c) == Divergence(1, tokens={"y": (1, 2)})


@pytest.fixture(scope="module")
def sim():
    wl = Workload.poisson(num_requests=10, rate=20.0, input_len=(8, 24), output_len=(6, 16), seed=3,
                          clock="wall")  # a step is 10 ms: an arrival every ~5 steps
    run = simulate(wl, teaching_config(num_kv_blocks=16), TEN_MS, output_len=(4, 12))
    assert run.summary()["num_preemptions"] > 0
    return run


def test_forking_a_simulated_run(sim):
    k = first_preemption(sim)
    same = sim.fork_at(k)
    assert same.simulated and first_divergence(sim, same) is None
    same_records(sim, same, range(sim.num_steps))
    assert same.requests.equals(sim.requests)  # simulated seconds too
    two = sim.fork_at(k, max_num_seqs=2)
    found = first_divergence(sim, two)
    assert found is not None and found.step >= k
    same_records(sim, two, range(k))
    assert two.config.max_num_seqs == 2 and two.simulated
    # a bigger budget without chunked prefill: every admission after the fork computes its whole prompt
    whole = sim.fork_at(k, max_num_batched_tokens=64, enable_chunked_prefill=False)
    after = [r for r in whole.history if r.step >= k]
    assert {r.scheduler_output.token_budget for r in after} == {64}
    assert {r.scheduler_output.token_budget for r in whole.history if r.step < k} == {32}
    admitted = [c for r in after for c in r.scheduler_output.scheduled
                if c.request_id in r.scheduler_output.new_request_ids + r.scheduler_output.resumed_request_ids]
    assert admitted and all(c.samples for c in admitted)
    with pytest.raises(ValueError, match="enable_chunked_prefill=False: request .* could never be scheduled"):
        sim.fork_at(k, max_num_batched_tokens=4, enable_chunked_prefill=False)


def test_a_branch_aborts_adds_and_reprioritises(sim):
    k = first_preemption(sim)
    victim = sim.history.record(k).scheduler_output.preempted_request_ids[0]
    later = max(sim.workload, key=lambda r: r.arrival_time).request_id
    assert later not in {e.request_id for r in sim.history if r.step <= k for e in r.request_events}
    extra = WorkloadRequest("extra", tuple(range(100, 110)), SamplingParams(max_tokens=3, ignore_eos=True))
    branch = sim.fork_at(k, abort=[victim, later], add=[extra])
    rows = branch.requests.set_index("request_id")
    assert rows.loc[victim, "finish_reason"] == "abort"
    assert later not in rows.index  # aborted before it arrived: it never does
    assert rows.loc["extra", "num_output_tokens"] == 3 and "extra" in [r.request_id for r in branch.workload]
    assert first_divergence(sim, branch).step >= k
    # priorities need a policy that reads them; the branch gets the workload's own for requests in flight
    with pytest.raises(ValueError, match="policy='priority'"):
        sim.fork_at(k, priority={victim: -1})
    first = sim.fork_at(k, policy="priority", priority={victim: -5})
    assert victim not in first.history.record(k).scheduler_output.preempted_request_ids  # served first now
    assert first.branch == f"from step {k}: policy=priority, priority {victim}=-5"
    # a branch of a branch replays the first branch's edits first
    deeper = branch.fork_at(k + 2, max_num_seqs=1)
    same_records(branch, deeper, range(k + 2))
    earlier = branch.fork_at(k - 1)  # before the branch's own fork: its edits still come at their step
    assert first_divergence(branch, earlier) is None and earlier.fork_step == k - 1
    assert earlier.branch == f"from step {k - 1}: nothing changed; {branch.branch}"


def test_bad_forks_are_refused_with_the_field(sim, real):
    with pytest.raises(ValueError, match=r"step must be an integer in \[0, "):
        sim.fork_at(sim.num_steps + 1)
    with pytest.raises(ValueError, match="abort: request 'nope' is not in the workload"):
        sim.fork_at(1, abort=["nope"])
    with pytest.raises(ValueError, match="add: request_id 'a' is already"):
        real.fork_at(1, add=[WORKLOAD.requests[0]])
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        sim.fork_at(1, max_num_seqs=0)
    # a source that does not repeat its run (here: a request less) is caught, not branched
    short = dataclasses.replace(sim.source, workload=Workload(list(sim.source.workload)[:-1], clock="wall"))
    with pytest.raises(RuntimeError, match="replaying the run did not repeat it"):
        dataclasses.replace(sim, source=short).fork_at(sim.num_steps - 1)
    wall = run_workload(Workload([dataclasses.replace(r, arrival_step=None, arrival_time=0.0) for r in WORKLOAD.requests[:1]],
                                 clock="wall"), CFG)
    with pytest.raises(ValueError, match="wall clock does not repeat"):
        wall.fork_at(0)
