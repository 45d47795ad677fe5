"""Exercise 4 (chunked prefill): the reference passes; three wrong splits a learner writes
fail at the step worked out by hand, naming the difference."""

from __future__ import annotations

import pytest

import workbench.exercises as ex
from workbench.exercises.batching import BatchWorkload, run_batches


def _schedule(running, waiting, budget, max_num_seqs, *, running_left, waiting_tokens):
    batch = []
    for r in running:
        if budget == 0:
            break
        n = min(running_left(r), budget)
        batch.append((r.request_id, n))
        budget -= n
    num_running = len(running)
    for r in waiting:
        if budget == 0 or num_running >= max_num_seqs:
            break
        n = waiting_tokens(r, budget)
        if n is None:
            break
        batch.append((r.request_id, n))
        budget -= n
        num_running += 1
    return batch


def no_split(running, waiting, max_num_batched_tokens, max_num_seqs):
    """Exercise 1's rule kept: a prompt that does not fit whole waits."""
    return _schedule(running, waiting, max_num_batched_tokens, max_num_seqs,
                     running_left=lambda r: r.num_tokens - r.num_computed_tokens,
                     waiting_tokens=lambda r, b: r.num_tokens if r.num_tokens <= b else None)


def running_decode_only(running, waiting, max_num_batched_tokens, max_num_seqs):
    """Treats every running request as decoding: one token, even part-way through a prompt."""
    return _schedule(running, waiting, max_num_batched_tokens, max_num_seqs, running_left=lambda r: 1,
                     waiting_tokens=lambda r, b: min(r.num_tokens, b))


def forgets_computed_tokens(running, waiting, max_num_batched_tokens, max_num_seqs):
    """Gives a running request min(num_tokens, budget), as if nothing were computed yet."""
    return _schedule(running, waiting, max_num_batched_tokens, max_num_seqs, running_left=lambda r: r.num_tokens,
                     waiting_tokens=lambda r, b: min(r.num_tokens, b))


# Worked by hand:
# LATE_LONG: step 0 r0:4; step 1 r0:1 (decode), r1 takes the 7 left of its 20-token prompt.
LATE_LONG = BatchWorkload(8, 4, (("r0", 0, 4, 3), ("r1", 1, 20, 1)))
# LONG: a 20-token prompt under a budget of 8: chunks 8, 8, 4 (samples), then one decode.
LONG = BatchWorkload(8, 4, (("r0", 0, 20, 2),))
HAND = {LATE_LONG: [[("r0", 4)], [("r0", 1), ("r1", 7)]], LONG: [[("r0", 8)], [("r0", 8)], [("r0", 4)], [("r0", 1)]]}


@pytest.mark.parametrize("workload", list(HAND), ids=["late_long", "long"])
def test_the_engine_makes_the_hand_worked_schedule(workload):
    engine = run_batches(workload, ex.reference("chunked_prefill"), enable_chunked_prefill=True)
    steps = [[(c.request_id, c.num_new_tokens) for c in r.scheduler_output.scheduled] for r in engine.history]
    assert steps[: len(HAND[workload])] == HAND[workload]


def test_the_reference_passes():
    result = ex.check("chunked_prefill", ex.reference("chunked_prefill"), max_examples=20)
    assert result.passed and result.first_wrong_step is None, result.message
    # exercise 1's reference is not this one: it never splits a prompt
    assert not ex.check("chunked_prefill", ex.reference("admission"), workloads=[LATE_LONG]).passed


@pytest.mark.parametrize("solution, workload, step, words", [
    (no_split, LATE_LONG, 1, ["waiting request r1 (20 to compute, 0 computed)", "gives it 7 with 7 of the budget left, yours 0"]),
    (running_decode_only, LONG, 1, ["running request r0 (12 to compute, 8 computed)", "gives it 8 with 8 of the budget left, yours 1"]),
    (forgets_computed_tokens, LONG, 2, ["running request r0 (4 to compute, 16 computed)", "gives it 4 with 8 of the budget left, yours 8",
                                        "engine: r0:4"]),
], ids=["no_split", "running_decode_only", "forgets_computed_tokens"])
def test_a_planted_mistake_fails_at_its_first_wrong_step(solution, workload, step, words):
    result = ex.check("chunked_prefill", solution, workloads=[workload])
    assert not result.passed and result.first_wrong_step == step
    for w in words:
        assert w in result.message, result.message


@pytest.mark.parametrize("solution", [no_split, running_decode_only, forgets_computed_tokens])
def test_the_drawn_workloads_find_each_planted_mistake(solution):
    result = ex.check("chunked_prefill", solution, max_examples=15)
    assert not result.passed and result.first_wrong_step is not None, result.message
