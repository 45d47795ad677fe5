"""The views show why: the StepPlayer's why column and not-scheduled table, the timeline's
waiting spans (the picked request's details) and the Perfetto wait slices' args, on the
simulated run of tests/engine/test_explain.py's workload, whose story is worked out there:
c preempted at step 5, short of KV blocks at 6-8, held by step 9's preemption, resumed at 10;
d waiting on max_num_seqs (2-4), a preemption (5, 9), behind c (6-8), KV blocks (10-11)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from test_explain import CFG, WORKLOAD  # noqa: E402

from workbench.lab.sim import CostModel, simulate  # noqa: E402
from workbench.metrics.perfetto import trace_events  # noqa: E402
from workbench.viz.player import StepPlayer  # noqa: E402
from workbench.viz.timeline import RequestTimeline  # noqa: E402


@pytest.fixture(scope="module")
def run():
    return simulate(WORKLOAD, CFG, CostModel({"step": 0.01}))


def test_player_why_column_and_left_out_requests(run):
    player = StepPlayer(run)
    player.show(0)
    assert [(r["request_id"], r["why"]) for r in player.batch_rows] == [
        ("a", ""), ("b", "a chunk of 5 of its 13 remaining tokens (the budget left)")]
    player.show(6)
    assert [(r["request_id"], r["reason"]) for r in player.why_rows] == [("c", "kv_blocks_short"),
                                                                         ("d", "behind_in_order")]
    html = player.batch.value
    assert "not scheduled" in html and "it needed 2, 0 were free" in html and "behind c" in html


def test_timeline_waiting_spans_carry_their_reasons(run):
    timeline = RequestTimeline(run)
    waits = {(s["request_id"], s["kind"]): s["reason"] for s in timeline.spans if s["kind"] in ("waiting", "preempted")}
    assert waits[("c", "preempted")] == "kv_blocks_short x3, preempted x1, preemption_in_step x1"
    assert waits[("d", "waiting")] == "max_num_seqs x3, behind_in_order x3, preemption_in_step x2, kv_blocks_short x2"
    timeline.select_request("c")
    assert "preempted 5–9 (why: kv_blocks_short x3" in timeline.details.value


def test_perfetto_wait_slices_carry_their_reasons(run):
    waits = {(e["name"], e["tid"]): e["args"]["reasons"] for e in trace_events(run.history)
             if e.get("cat") in ("waiting", "preempted") and e["args"]["reasons"]}
    assert sorted(waits.values(), key=len) == [
        {"preempted": 1},
        {"preempted": 1, "kv_blocks_short": 3, "preemption_in_step": 1},
        {"max_num_seqs": 3, "preemption_in_step": 2, "behind_in_order": 3, "kv_blocks_short": 2},
    ]
