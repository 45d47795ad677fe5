"""Each router's assignments against a sequence worked out by hand (ties included)."""

import random

import pytest

from workbench.cluster import (CacheAware, Cluster, LeastRequests, PowerOfTwo, PrecisePrefix, ReplicaView, RoundRobin,
                               RoutedRequest, Router, Routing, Session, WeightedScorers)
from workbench.cluster.radix_tree import RadixTree
from workbench.core.kv_cache_utils import hash_request_blocks
from workbench.core.kv_event_batch import BlockRemoved, BlockStored, KVEventBatch
from workbench.lab.workload import Workload, WorkloadRequest
from workbench.sampling_params import SamplingParams


def _wr(rid, tokens, session=None):
    r = WorkloadRequest(rid, tuple(tokens), SamplingParams(max_tokens=2, ignore_eos=True), arrival_time=0.0)
    if session is not None:
        object.__setattr__(r, "session_id", session)
    return r


def _arrival(rid, tokens, t=0.0, session=None):
    return RoutedRequest(rid, _wr(rid, tokens, session), t)


def _views(load=None, waiting=None, usage=None, block_size=4, n=None):
    n = n or len(load or waiting or usage)
    load = load or [0] * n
    waiting = waiting or [0] * n
    usage = usage or [0.0] * n
    return [ReplicaView(i, load[i], waiting[i], load[i] - waiting[i], usage[i], 0, block_size, 0.0)
            for i in range(n)]


def _route(router, request, views):
    answer = router.route(request, views)
    return answer.replica if isinstance(answer, Routing) else answer


def test_round_robin_in_turn_whatever_the_load():
    router = RoundRobin()
    got = [_route(router, _arrival(f"r{i}", [1, 2]), _views(load=[9, 0, 0])) for i in range(5)]
    assert got == [0, 1, 2, 0, 1]


def test_least_requests_ties_to_the_lowest_index():
    router = LeastRequests()
    assert _route(router, _arrival("a", [1]), _views(load=[2, 1, 1])) == 1
    assert _route(router, _arrival("b", [1]), _views(load=[0, 0, 0])) == 0
    assert _route(router, _arrival("c", [1]), _views(load=[3, 2, 0])) == 2


def test_power_of_two_draws_two_from_its_seed_and_ties_to_the_first_drawn():
    loads = [[3, 1, 1, 0], [0, 0, 0, 0], [1, 4, 2, 2], [5, 5, 1, 5]]
    rng = random.Random(7)  # the documented draws: random.Random(seed).sample(range(n), 2)
    expected = []
    for load in loads:
        a, b = rng.sample(range(4), 2)
        expected.append(a if load[a] <= load[b] else b)
    router = PowerOfTwo(seed=7)
    assert [_route(router, _arrival(f"r{i}", [1]), _views(load=l)) for i, l in enumerate(loads)] == expected


def test_session_affinity_by_key():
    """u1 -> least loaded (1); u2 -> least loaded then (0, a tie with 2 goes low); u1 sticks to 1
    although 2 is idle; no key -> least requests; u2 sticks to 0."""
    router = Session()
    seq = [("u1", [3, 0, 1]), ("u2", [0, 1, 0]), ("u1", [5, 5, 0]), (None, [2, 1, 3]), ("u2", [9, 0, 0])]
    got = [_route(router, _arrival(f"r{i}", [1], session=key), _views(load=load)) for i, (key, load) in enumerate(seq)]
    assert got == [1, 0, 1, 1, 0]
    keyed = Session(key=lambda req: req.prompt_token_ids[0])
    assert [_route(keyed, _arrival(f"k{i}", [t]), _views(load=[i, 0])) for i, t in enumerate([7, 8, 7])] == [0, 1, 0]


def test_cache_aware_by_hand():
    """Two idle replicas, SGLang's defaults (threshold 0.3).
    A 1..10: empty tree, smallest trees tie -> 0 (tree sizes [10, 0]).
    B 1..5,50..54: replica 0 holds 5/10 = 0.5 > 0.3 -> 0 (sizes [15, 0]).
    C 60..69: no match -> smallest tree -> 1 (sizes [15, 10]).
    D 1,2,70..77: 0 holds 2/10 = 0.2 <= 0.3 -> smallest tree -> 1 (sizes [15, 20]).
    E 1,2,70,71,90..95: 1 holds 4/10, 0 holds 2/10 -> 1.
    F = A again with loads [70, 4]: 66 > 64 and 70 > 1.5 * 4 -> unbalanced -> least loaded 1."""
    router = CacheAware()
    A, B = list(range(1, 11)), [1, 2, 3, 4, 5, 50, 51, 52, 53, 54]
    C, D, E = list(range(60, 70)), [1, 2, *range(70, 78)], [1, 2, 70, 71, *range(90, 96)]
    got = []
    for rid, tokens in zip("ABCDE", (A, B, C, D, E)):
        answer = router.route(_arrival(rid, tokens), _views(load=[0, 0]))
        got.append(answer.replica)
    assert got == [0, 0, 1, 1, 1]
    assert answer.scores["match"] == [0.2, 0.4] and answer.scores["tree_size"] == [15, 20]
    assert _route(router, _arrival("F", A), _views(load=[70, 4])) == 1
    assert _route(router, _arrival("G", A), _views(load=[70, 10])) == 0  # 60 <= 64: balanced, A's prefix is on 0
    tie = CacheAware()
    tie.tree.insert([1, 2, 3], 0, 0.0)
    tie.tree.insert([1, 2, 3], 1, 0.0)
    assert _route(tie, _arrival("H", [1, 2, 3, 4]), _views(load=[1, 1])) == 0  # equal matches -> lowest index


def test_radix_tree_match_split_and_lru_eviction():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], 0, now=1.0)
    tree.insert([1, 2, 9], 1, now=2.0)
    tree.insert([5, 6], 0, now=3.0)
    assert tree.match([1, 2, 3, 7]) == {0: 3, 1: 2}
    assert tree.size == {0: 6, 1: 3}
    tree.evict(max_size=4)  # tenant 0's least recently used leaf is [3, 4] (t=1); then it fits
    assert tree.size == {0: 4, 1: 3}
    assert tree.match([1, 2, 3, 4]) == {0: 2, 1: 2} and tree.match([5, 6]) == {0: 2}


def test_llm_d_weighted_scorers_by_hand():
    """waiting [2, 0, 1] -> queue [0, 1, 0.5]; usage [0.5, 0.25, 0] -> kv [0.5, 0.75, 1];
    no prefix yet: totals 2q + 2kv = [1, 3.5, 3] -> 1. The same prompt again, replica 1's LRU
    has both its blocks: prefix [0, 1, 0], totals [1, 6.5, 3] -> 1. A prompt sharing the first
    block only, with replica 1 busiest: prefix [0, 0.5, 0], queue [1, 0, 1], kv all 1 ->
    totals [4, 3.5, 4]: a tie of 0 and 2, broken by the first draw of the seed (no tie before)."""
    router = WeightedScorers()
    views = _views(load=[2, 0, 1], waiting=[2, 0, 1], usage=[0.5, 0.25, 0.0])
    first = router.route(_arrival("a", range(8)), views)
    assert first.replica == 1 and first.scores["total"] == [1.0, 3.5, 3.0]
    second = router.route(_arrival("b", range(8)), views)
    assert second.replica == 1 and second.scores["prefix"] == [0.0, 1.0, 0.0]
    third = router.route(_arrival("c", [0, 1, 2, 3, 9, 9, 9, 9]), _views(load=[0, 3, 0], waiting=[0, 3, 0]))
    assert third.scores["prefix"] == [0.0, 0.5, 0.0] and third.scores["total"] == [4.0, 3.5, 4.0]
    assert third.replica == random.Random(0).choice([0, 2])
    other = WeightedScorers(seed=3)
    tied = [other.route(_arrival(f"t{i}", [9] * 3), _views(load=[0, 0, 0])).replica for i in range(6)]
    rng = random.Random(3)
    assert tied == [rng.choice([0, 1, 2]) for _ in range(6)] and len(set(tied)) > 1
    with pytest.raises(ValueError, match="weights"):
        WeightedScorers({"nope": 1.0})


def test_precise_prefix_reads_kv_events():
    """Replica 1 stored the prompt's first block, replica 2 both (then one of them evicted)."""
    prompt = list(range(8))
    h = hash_request_blocks(prompt, 4)
    router = PrecisePrefix(weights={"prefix": 1.0})
    router.on_kv_events(1, KVEventBatch(0.0, [BlockStored([h[0]], None, prompt[:4], 4, None, "GPU")]))
    router.on_kv_events(2, KVEventBatch(0.0, [BlockStored(h, None, prompt, 4, None, "GPU")]))
    answer = router.route(_arrival("a", prompt), _views(load=[0, 0, 0]))
    assert answer.replica == 2 and answer.scores["prefix"] == [0.0, 0.5, 1.0]
    router.on_kv_events(2, KVEventBatch(0.1, [BlockRemoved([h[0]], "GPU")]))
    answer = router.route(_arrival("b", prompt), _views(load=[0, 0, 0]))
    assert answer.replica == 1 and answer.scores["prefix"] == [0.0, 0.5, 0.0]


def test_a_router_of_your_own_in_a_cluster():
    class Last(Router):
        name = "last"

        def route(self, request, replicas):
            return len(replicas) - 1

    wl = Workload([_wr(f"r{i}", [5, 6, 7]) for i in range(3)], clock="wall")
    result = Cluster.simulated(3, {"num_kv_blocks": 16}, router=Last()).run(wl)
    assert list(result.decisions["replica"]) == [2, 2, 2] and result.router == "last"
    with pytest.raises(ValueError, match="chose replica 7"):
        Cluster.simulated(2, router=type("Bad", (Router,), {"route": lambda self, r, v: 7})()).run(wl)


def test_radix_tree_eviction_climbs_to_the_parent_once_it_is_a_leaf():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], 0, now=1.0)
    tree.insert([1, 2, 9], 1, now=2.0)
    tree.insert([5, 6], 0, now=3.0)
    tree.evict(max_size=3)  # [3, 4] (t=1) goes, then [1, 2] is tenant 0's leaf (t=1) and goes too
    assert tree.size == {0: 2, 1: 3}
    assert tree.match([1, 2, 9]) == {1: 3} and tree.match([5, 6]) == {0: 2}
