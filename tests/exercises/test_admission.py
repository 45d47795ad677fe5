"""Exercise 1 (admission loop, chunked prefill off): the reference passes; three wrong
solutions a learner writes fail at the step worked out by hand, naming the difference."""

from __future__ import annotations

import pytest

import workbench.exercises as ex
from workbench.exercises.batching import BatchWorkload, run_batches


def _decode_running(running, budget):
    batch = []
    for r in running:
        if budget == 0:
            break
        n = min(r.num_tokens - r.num_computed_tokens, budget)
        batch.append((r.request_id, n))
        budget -= n
    return batch, budget


def off_by_one(running, waiting, max_num_batched_tokens, max_num_seqs):
    """Admits a prompt only if it is strictly smaller than the budget left."""
    batch, budget = _decode_running(running, max_num_batched_tokens)
    num_running = len(running)
    for r in waiting:
        if budget == 0 or num_running >= max_num_seqs or r.num_tokens >= budget:
            break
        batch.append((r.request_id, r.num_tokens))
        budget -= r.num_tokens
        num_running += 1
    return batch


def ignores_max_num_seqs(running, waiting, max_num_batched_tokens, max_num_seqs):
    batch, budget = _decode_running(running, max_num_batched_tokens)
    for r in waiting:
        if budget == 0 or r.num_tokens > budget:
            break
        batch.append((r.request_id, r.num_tokens))
        budget -= r.num_tokens
    return batch


def waiting_first(running, waiting, max_num_batched_tokens, max_num_seqs):
    """Forgets that the running queue is served first."""
    batch, budget, num_running = [], max_num_batched_tokens, len(running)
    for r in waiting:
        if budget == 0 or num_running >= max_num_seqs or r.num_tokens > budget:
            break
        batch.append((r.request_id, r.num_tokens))
        budget -= r.num_tokens
        num_running += 1
    return batch + _decode_running(running, budget)[0]


# Worked by hand (prompt lengths, arrivals, one decode token per running request per step):
# EXACT_FIT: step 0 r0:5; step 1 r0:1 then r1 needs 7 of the 7 left -> admitted.
EXACT_FIT = BatchWorkload(8, 4, (("r0", 0, 5, 3), ("r1", 1, 7, 2)))
# SEQ_CAP: step 0 r0:3 r1:3 (cap 2 reached); step 1 r0:1 r1:1, r2 waits for a free seat.
SEQ_CAP = BatchWorkload(16, 2, (("r0", 0, 3, 3), ("r1", 0, 3, 3), ("r2", 1, 3, 2)))
# RUNNING_FIRST: step 0 r0:4; step 1 r0:1, then r1 needs 8 > 7 left -> waits; step 2 r0:1 ...
RUNNING_FIRST = BatchWorkload(8, 4, (("r0", 0, 4, 3), ("r1", 1, 8, 2)))
HAND = {
    EXACT_FIT: [[("r0", 5)], [("r0", 1), ("r1", 7)]],
    SEQ_CAP: [[("r0", 3), ("r1", 3)], [("r0", 1), ("r1", 1)]],
    RUNNING_FIRST: [[("r0", 4)], [("r0", 1)], [("r0", 1)]],
}


@pytest.mark.parametrize("workload", list(HAND), ids=["exact_fit", "seq_cap", "running_first"])
def test_the_engine_makes_the_hand_worked_schedule(workload):
    engine = run_batches(workload, ex.reference("admission"), enable_chunked_prefill=False)
    steps = [[(c.request_id, c.num_new_tokens) for c in r.scheduler_output.scheduled] for r in engine.history]
    assert steps[: len(HAND[workload])] == HAND[workload]


def test_the_reference_passes_on_drawn_and_hand_worked_workloads():
    assert ex.reference("admission") is not None
    result = ex.check("admission", ex.reference("admission"), max_examples=20)
    assert result.passed and result.first_wrong_step is None, result.message
    assert ex.check("admission", ex.reference("admission"), workloads=list(HAND)).passed


@pytest.mark.parametrize("solution, workload, step, words", [
    (off_by_one, EXACT_FIT, 1, ["waiting request r1", "gives it 7 with 7 of the budget left, yours 0"]),
    (ignores_max_num_seqs, SEQ_CAP, 1, ["3 requests running > max_num_seqs=2", "yours schedules waiting request r2"]),
    (waiting_first, RUNNING_FIRST, 1, ["running request r0", "gives it 1 with 8 of the budget left, yours 0"]),
], ids=["off_by_one", "ignores_max_num_seqs", "waiting_first"])
def test_a_planted_mistake_fails_at_its_first_wrong_step(solution, workload, step, words):
    result = ex.check("admission", solution, workloads=[workload])
    assert not result.passed
    assert result.first_wrong_step == step
    for w in words:
        assert w in result.message, result.message
    assert dict(result.expected) != dict(result.got)


@pytest.mark.parametrize("solution", [off_by_one, ignores_max_num_seqs, waiting_first])
def test_the_drawn_workloads_find_each_planted_mistake(solution):
    result = ex.check("admission", solution, max_examples=15)
    assert not result.passed and result.first_wrong_step is not None
    assert "your batch differs from the engine's" in result.message


def test_the_feedback_is_reproducible():
    assert ex.check("admission", off_by_one, max_examples=15).message == \
        ex.check("admission", off_by_one, max_examples=15).message


def test_show_opens_the_player_at_the_first_wrong_step():
    result = ex.check("admission", waiting_first, workloads=[RUNNING_FIRST])
    table, player = result.show().children
    assert player.step == 1
    assert "r0" in table.value and "engine (reference)" in table.value
    assert result.hint().startswith("Hint 1/3") and result.hint().startswith("Hint 2/3")


def test_a_malformed_answer_is_named():
    result = ex.check("admission", lambda *a: 3, workloads=[EXACT_FIT])
    assert result.first_wrong_step == 0 and "must return a list of (request_id, num_new_tokens)" in result.message
    result = ex.check("admission", lambda *a: 1 / 0, workloads=[EXACT_FIT])
    assert "your code raised ZeroDivisionError" in result.message
