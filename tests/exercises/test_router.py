"""Exercise 6 (prefix-aware router): the reference passes; a round robin, a shortest queue and a
router that breaks ties by the lowest index fail at the decision worked out by hand."""

from __future__ import annotations

import pytest

import workbench.exercises as ex
from workbench.exercises.routing import RoutingWorkload, run_routing
from workbench.lab.workload import Workload, WorkloadRequest
from workbench.sampling_params import SamplingParams


class RoundRobin:
    """Ignores the prefix: replicas in turn (a callable object, so each run starts from 0)."""

    def __init__(self):
        self.next = 0

    def __call__(self, prompt_blocks, cached, waiting):
        choice = self.next % len(cached)
        self.next += 1
        return choice


def shortest_queue(prompt_blocks, cached, waiting):
    return min(range(len(waiting)), key=waiting.__getitem__)


def lowest_index_ties(prompt_blocks, cached, waiting):
    """The longest cached prefix, but ties go to the first replica, whatever its queue."""
    def leading(held):
        n = 0
        while n < len(prompt_blocks) and prompt_blocks[n] in held:
            n += 1
        return n

    counts = [leading(held) for held in cached]
    return counts.index(max(counts))


def _request(rid, tokens, arrival):
    return WorkloadRequest(rid, tuple(tokens), SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False),
                           arrival_time=arrival)


A, B = list(range(10, 18)), list(range(20, 28))  # two full blocks of 4 tokens each
# Worked by hand (2 replicas): r0 and r1 arrive together at 0 -- r0 finds both replicas empty and
# idle (any is right; every planted router takes 0), r1 finds nothing cached and r0 waiting on
# replica 0, so it goes to replica 1. By t=1 both finished: replica 0 caches A's two blocks,
# replica 1 B's; r2 opens with B, so it goes to replica 1.
HAND = RoutingWorkload(2, 16, Workload([_request("r0", A + [50], 0.0), _request("r1", B + [51], 0.0),
                                        _request("r2", B + [52], 1.0)], clock="wall"), "worked by hand")


def test_the_cluster_routes_as_worked_by_hand():
    result = run_routing(HAND, ex.reference("router"))
    assert list(result.decisions["replica"]) == [0, 1, 1]
    assert result.replicas[1].prefix_hits == 8 and result.replicas[0].prefix_hits == 0


def test_the_reference_passes_and_reports_its_effect():
    result = ex.check("router", ex.reference("router"), max_examples=10)
    assert result.passed and result.first_wrong_step is None, result.message
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in result.message.splitlines()[-3:]}
    assert set(rows) == {"yours", "reference", "round_robin"}
    # the prefixes do not all fit one replica: routing by prefix keeps more of them cached
    assert rows["reference"][0] > rows["round_robin"][0] + 0.2 and rows["yours"][0] > rows["round_robin"][0] + 0.2


@pytest.mark.parametrize("solution, decision, words", [
    (RoundRobin(), 2, ["request r2", "The reference sends it to replica 1; yours to replica 0",
                       "replica 0: 0 of 2 leading blocks cached, 0 waiting; replica 1: 2 of 2 leading blocks cached",
                       "shorter cached prefix"]),
    (shortest_queue, 2, ["The reference sends it to replica 1; yours to replica 0", "shorter cached prefix"]),
    (lowest_index_ties, 1, ["request r1", "The reference sends it to replica 1; yours to replica 0",
                            "replica 0: 0 of 2 leading blocks cached, 1 waiting; replica 1: 0 of 2 leading blocks "
                            "cached, 0 waiting", "the tie goes to the fewest waiting requests"]),
], ids=["round_robin", "shortest_queue", "lowest_index_ties"])
def test_a_planted_mistake_fails_at_its_first_wrong_decision(solution, decision, words):
    result = ex.check("router", solution, workloads=[HAND])
    assert not result.passed and result.first_wrong_step == decision and result.unit == "decision"
    for w in words:
        assert w in result.message, result.message
    shown = result.show().children
    assert f"decision {decision}" in shown[0].value and "leading blocks cached" in shown[0].value
    if decision == 2:  # replica 1 ran r1 (its prefill, step 0; its second token, step 1): the player there
        assert shown[1].step == 1
    else:  # replica 1 has not stepped yet: no player
        assert len(shown) == 1


@pytest.mark.parametrize("solution", [RoundRobin(), shortest_queue, lowest_index_ties])
def test_the_drawn_workloads_find_each_planted_mistake(solution):
    result = ex.check("router", solution, max_examples=10)
    assert not result.passed and result.first_wrong_step is not None
    assert "The reference sends it to replica" in result.message


def test_a_bad_answer_is_named():
    result = ex.check("router", lambda blocks, cached, waiting: 7, workloads=[HAND])
    assert result.first_wrong_step == 0 and "must return a replica index, 0..1" in result.message
