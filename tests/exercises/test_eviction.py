"""Exercise 3 (free-block queue): the reference passes; a newest-first queue, a head-first
release and a queue that ignores prefix hits fail at the step worked out by hand."""

from __future__ import annotations

import pytest

import workbench.exercises as ex
from workbench.core.kv_events import BlockAllocated
from workbench.exercises.eviction import EvictionWorkload, run_eviction


class NewestFirst:
    """Evicts the most recently freed block (a stack, not a queue)."""

    def __init__(self, block_ids):
        self.blocks = list(block_ids)

    def free(self, block_ids):
        self.blocks.extend(reversed(block_ids))

    def remove(self, block_id):
        self.blocks.remove(block_id)

    def popleft(self):
        return self.blocks.pop()

    def __iter__(self):
        return iter(self.blocks)


class HeadFirst(NewestFirst):
    """A queue, but a request's blocks are released in table order (first block first)."""

    def free(self, block_ids):
        self.blocks.extend(block_ids)

    def popleft(self):
        return self.blocks.pop(0)


class IgnoresHits(NewestFirst):
    """A queue with vLLM's order that forgets to take a prefix-hit block out of it."""

    def remove(self, block_id):
        pass

    def popleft(self):
        return self.blocks.pop(0)


# Worked by hand (blocks of 2 tokens, 4 blocks, one output token each): step 0 r0 takes 0, 1, 2
# and releases them tail first -> queue [3, 2, 1, 0]; step 1 r1 hits 0, 1 and takes 3 -> after
# its release [2, 3, 1, 0]; step 2 r2 takes 2, 3, 1.
SHARED = EvictionWorkload(4, 2, (("r0", 0, (10, 11, 12, 13, 14), 1), ("r1", 1, (10, 11, 12, 13, 30), 1),
                                 ("r2", 2, (40, 41, 42, 43, 44), 1)))


def test_the_engine_evicts_as_worked_by_hand():
    engine = run_eviction(SHARED, ex.reference("eviction"))
    taken = [[e.block_id for e in r.kv_events if isinstance(e, BlockAllocated) and not e.prefix_hit]
             for r in engine.history]
    hits = [[e.block_id for e in r.kv_events if isinstance(e, BlockAllocated) and e.prefix_hit] for r in engine.history]
    assert taken == [[0, 1, 2], [3], [2, 3, 1]] and hits == [[], [0, 1], []]


def test_the_reference_passes():
    result = ex.check("eviction", ex.reference("eviction"), max_examples=25)
    assert result.passed and result.first_wrong_step is None, result.message


@pytest.mark.parametrize("solution, step, words", [
    (NewestFirst, 0, ["took block 0", "gave 3", "the back of the queue, the block freed most recently"]),
    (HeadFirst, 2, ["took block 3", "the 3rd of the 3 blocks it released", "gave 0", "the 1st of the 3 blocks"]),
    (IgnoresHits, 2, ["took block 3", "gave 1", "Yours just before (iterated): [1, 0, 3, 1, 0]"]),
], ids=["newest_first", "head_first", "ignores_hits"])
def test_a_planted_mistake_fails_at_its_first_wrong_step(solution, step, words):
    result = ex.check("eviction", solution, workloads=[SHARED])
    assert not result.passed and result.first_wrong_step == step
    for w in words:
        assert w in result.message, result.message
    table, player = result.show().children
    assert player.step == step and "which block is evicted" in table.value


@pytest.mark.parametrize("solution", [NewestFirst, HeadFirst, IgnoresHits])
def test_the_drawn_workloads_find_each_planted_mistake(solution):
    result = ex.check("eviction", solution, max_examples=20)
    assert not result.passed and result.first_wrong_step is not None
    assert "needed a new block" in result.message


def test_a_missing_method_is_named():
    class NoRemove(HeadFirst):
        remove = None

    result = ex.check("eviction", NoRemove, workloads=[SHARED])
    assert result.first_wrong_step == 1 and "your code raised TypeError" in result.message
