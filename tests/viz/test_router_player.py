"""RouterPlayer and ClusterDashboard: every candidate's state at a decision, from a replay of
the run, checked against a small schedule worked out by hand; regret on request."""

import pytest

from workbench.cluster import Cluster
from workbench.cluster.candidates import candidate_states
from workbench.cluster.shared_prefix import shared_prefix_workload
from workbench.lab.sim import CostModel
from workbench.lab.workload import Workload, WorkloadRequest
from workbench.sampling_params import SamplingParams
from workbench.viz.cluster_dashboard import ClusterDashboard
from workbench.viz.router_player import RouterPlayer

SMALL = {"block_size": 4, "num_kv_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 64}
P = tuple(range(10, 22))  # a 12-token shared prefix: 3 blocks of 4


def _req(rid, prompt, step):
    return WorkloadRequest(rid, prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                           arrival_step=step)


@pytest.fixture(scope="module")
def hand():
    """Round robin on 2 replicas: a (P + 2 tokens) -> 0 at step 0, b (other) -> 1 at 0,
    c (P + 3 tokens) -> 0 at step 10, when a has finished and left P's 3 blocks cached on 0."""
    wl = Workload([_req("a", P + (40, 41), 0), _req("b", tuple(range(50, 64)), 0), _req("c", P + (70, 71, 72), 10)],
                  clock="steps")
    return Cluster.simulated(2, SMALL, cost_model=CostModel({"step": 0.01})).run(wl)


def test_candidates_by_hand(hand):
    frame = candidate_states(hand)
    assert len(frame) == 3 * 2 and frame["chosen"].tolist() == [True, False, False, True, True, False]
    c = frame[frame["request_id"] == "c"].set_index("replica")
    assert c.loc[0, "cached_tokens"] == 12 and c.loc[1, "cached_tokens"] == 0  # P's 3 full blocks, on 0 only
    assert c.loc[0, "prefix_match"] == pytest.approx(12 / 15) and (c["prompt_tokens"] == 15).all()
    assert c["num_requests"].tolist() == [0, 0]  # both finished by step 10
    b = frame[frame["request_id"] == "b"].set_index("replica")
    assert b.loc[0, "num_waiting"] == 1 and b.loc[0, "num_requests"] == 1  # a waits on 0: no step yet
    assert (frame["score_requests"] == frame["num_requests"]).all()  # round robin's own record of the load
    # the run's own record agrees: c found P's blocks on replica 0
    assert hand.requests.set_index("request_id").loc["c", "num_cached_tokens"] == 12


def test_player_shows_a_decision_and_its_regret(hand):
    player = RouterPlayer(hand)
    assert player.index == 0 and [r["replica"] for r in player.rows] == [0, 1]
    player.show(2)
    assert player.slider.value == 2 and player.index == 2 and player.play.value == 2
    assert [r["cached_tokens"] for r in player.rows] == [12, 0]
    assert "replica 0" in player.heading.value and "c arrives at 10 step, 15 prompt tokens" in player.heading.value
    player.show(99)
    assert player.index == 2  # clamped
    player.ask_regret()
    assert len(player.regret_rows) == 1 and player.regret_rows[0]["alternative"] == 1
    by_fork = hand.fork("c", 1).requests.set_index("request_id").loc["c", "ttft_steps"]
    own = hand.requests.set_index("request_id").loc["c", "ttft_steps"]
    assert player.regret_rows[0]["ttft_delta"] == by_fork - own
    assert "regret" in player.regret_view.value
    player.show(0)
    assert player.regret_rows == []  # regret belongs to the decision it was asked for
    assert "<img" in player._repr_html_()


def test_dashboard_opens_tabs_when_picked():
    wl = shared_prefix_workload(40, 100.0, num_groups=3, prefix_len=32, input_len=(40, 48))
    result = Cluster.simulated(3, {"block_size": 16, "num_kv_blocks": 64}, router="cache_aware").run(wl)
    board = ClusterDashboard(result)
    assert board.player is None and board.timeline is None and "prefix_hit_rate" in board.tabs.children[0].value
    board.tabs.selected_index = 2
    assert board.player is not None and len(board.player.candidates) == 40 * 3
    assert {"score_match", "score_requests", "score_tree_size"} <= set(board.player.candidates.columns)
    board.tabs.selected_index = 1
    assert board.timeline is not None
