"""Exercise 2 (shortest prompt first): the reference passes; three wrong policies a learner
writes fail at the step worked out by hand; starvation is measured."""

from __future__ import annotations

import pytest

import workbench.exercises as ex
from workbench.core.sched.policies import SchedulingPolicy
from workbench.exercises.policy import PolicyWorkload, run_policy, starvation


class LongestFirst(SchedulingPolicy):
    """The sign the wrong way round."""

    def sort_key(self, request):
        return (-request.num_prompt_tokens, request.arrival_time)


class ByNumTokens(SchedulingPolicy):
    """Orders by all known tokens: a preempted request's outputs count against it."""

    def sort_key(self, request):
        return (request.num_tokens, request.arrival_time)


class NoTieBreak(SchedulingPolicy):
    """No arrival tie-break: a re-entering preempted request loses its place to later arrivals."""

    def sort_key(self, request):
        return request.num_prompt_tokens


# Worked by hand (blocks of 2 tokens):
# SMALL: step 0 r0:2; step 1 r0 decodes (one seat); step 2 SPF serves r2 (prompt 1) before r1 (5).
SMALL = PolicyWorkload(16, 4, 1, (("r0", 0, 2, 2), ("r1", 1, 5, 1), ("r2", 1, 1, 1)))
# VICTIM: 2 blocks. Step 0 r1:1 r2:1 (r2 done); step 1 r1:1 r0:1; step 2 r1 needs a block: SPF's
# victim is r0 (equal prompts, later arrival), then r1:1; by num_tokens the victim is r1 (3 tokens).
VICTIM = PolicyWorkload(2, 4, 2, (("r0", 1, 1, 2), ("r1", 0, 1, 3), ("r2", 0, 1, 1)))
# REENTRY: 2 blocks. Step 0 r0:1 r1:2; step 1 r1 needs a block and is its own victim, r0:1 (done);
# step 2 SPF serves r2 then the re-entered r1 (arrived at step 0) before r3 (arrived at step 1).
REENTRY = PolicyWorkload(2, 4, 2, (("r0", 0, 1, 2), ("r1", 0, 2, 2), ("r2", 0, 2, 1), ("r3", 1, 2, 1)))
HAND = {
    SMALL: ([{"r0": 2}, {"r0": 1}, {"r2": 1}], [(), (), ()]),
    VICTIM: ([{"r1": 1, "r2": 1}, {"r1": 1, "r0": 1}, {"r1": 1}], [(), (), ("r0",)]),
    REENTRY: ([{"r0": 1, "r1": 2}, {"r0": 1}, {"r2": 2, "r1": 2}], [(), ("r1",), ()]),
}


@pytest.mark.parametrize("workload", list(HAND), ids=["small", "victim", "reentry"])
def test_the_engine_makes_the_hand_worked_schedule(workload):
    engine = run_policy(workload, ex.reference("policy")())
    outs = [r.scheduler_output for r in engine.history][: len(HAND[workload][0])]
    assert [{c.request_id: c.num_new_tokens for c in o.scheduled} for o in outs] == HAND[workload][0]
    assert [o.preempted_request_ids for o in outs] == HAND[workload][1]


def test_the_reference_passes():
    result = ex.check("policy", ex.reference("policy"), max_examples=20)
    assert result.passed and result.first_wrong_step is None, result.message


@pytest.mark.parametrize("solution, workload, step, words", [
    (LongestFirst, SMALL, 2, ["shortest-prompt-first ran r2:1; yours ran r1:4"]),
    (ByNumTokens, VICTIM, 2, ["shortest-prompt-first ran r1:1; yours ran nothing",
                              "Preempted: shortest-prompt-first ['r0'], yours ['r1']"]),
    (NoTieBreak, REENTRY, 2, ["shortest-prompt-first ran r2:2, r1:2; yours ran r2:2, r3:2",
                              "yours [r2 (prompt 2), r3 (prompt 2), r1 (prompt 2, 3 tokens)]"]),
], ids=["longest_first", "by_num_tokens", "no_tie_break"])
def test_a_planted_mistake_fails_at_its_first_wrong_step(solution, workload, step, words):
    result = ex.check("policy", solution, workloads=[workload])
    assert not result.passed and result.first_wrong_step == step
    for w in words:
        assert w in result.message, result.message
    table, player = result.show().children
    assert player.step == step


@pytest.mark.parametrize("solution", [LongestFirst, ByNumTokens])
def test_the_drawn_workloads_find_planted_mistakes(solution):
    result = ex.check("policy", solution, max_examples=20)
    assert not result.passed and result.first_wrong_step is not None


def test_a_solution_that_is_no_policy_is_named():
    result = ex.check("policy", lambda: 3)
    assert not result.passed and "SchedulingPolicy subclass or instance" in result.message


def test_shortest_prompt_first_starves_the_longest_prompts():
    table = starvation({"fcfs": "fcfs", "spf": ex.reference("policy")})
    assert table.loc["spf", "mean TTFT"] < table.loc["fcfs", "mean TTFT"]
    assert table.loc["spf", "longest prompts: mean TTFT"] > 2 * table.loc["fcfs", "longest prompts: mean TTFT"]
