"""``workbench bench scheduler``: the step-cost table, the runner-preparation table (whose
persistent batch is checked against the from-scratch rebuild on every timed step) and the engine's
host time per step (every timed step checked to be N decodes)."""

from __future__ import annotations

import argparse

import pytest

from workbench.benchmarks import scheduler
from workbench.core.sched.output import ScheduledRequest, SchedulerOutput
from workbench.worker.batch_inputs import build_batch_inputs


def test_tables_print_a_row_per_size(capsys):
    assert scheduler.main(["--num-running", "1", "5", "--steps", "20", "--prompt-len", "20",
                           "--events", "off"]) == 0
    out = capsys.readouterr().out
    assert "runner preparation" in out
    prep = out.split("runner preparation")[1].split("engine step host time")[0].splitlines()[3:]
    assert [line.split()[0] for line in prep if line.strip()] == ["1", "5"]
    engine_rows = [line.split() for line in out.split("engine step host time")[1].splitlines()[3:] if line.strip()]
    assert [(r[0], " ".join(r[1:3])) for r in engine_rows] == [
        ("1", "final, ids"), ("1", "delta, text"), ("5", "final, ids"), ("5", "delta, text")]
    assert all(float(r[3]) > 0 for r in engine_rows)


def test_a_different_batch_is_caught():
    so = SchedulerOutput(step=0, scheduled=(
        ScheduledRequest("a", 5, 1, (9,), (3, 7), is_prefill=False, samples=True),))
    other = SchedulerOutput(step=0, scheduled=(
        ScheduledRequest("a", 5, 1, (9,), (3, 8), is_prefill=False, samples=True),))
    assert scheduler._same(build_batch_inputs(so, 4), build_batch_inputs(so, 4))
    assert not scheduler._same(build_batch_inputs(so, 4), build_batch_inputs(other, 4))


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit):
        scheduler.main(["--num-running", "0"])


def test_small_blocks_change_tables_every_few_steps_and_still_match():
    """Block size 4: a new block every 4 decode steps per request (the tail writes); the
    measurement raises if a step's persistent batch differs from the rebuild."""
    r = scheduler._measure_prepare(3, argparse.Namespace(
        prompt_len=5, block_size=4, steps=12, max_num_batched_tokens=64, policy="fcfs",
        no_prefix_caching=False))
    assert r["running"] == 3 and r["scratch_us"] > 0 and r["persistent_us"] > 0


def test_why_rows_with_waiting_requests(capsys):
    """--why both: a row without the explainer (0% share) and one with it, whose share of the
    step is a fraction; --waiting keeps requests waiting behind max_num_seqs."""
    assert scheduler.main(["--num-running", "4", "--waiting", "8", "--steps", "10", "--prompt-len", "20",
                           "--events", "off", "--why", "both"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.split("runner preparation")[0].splitlines()[3:]
            if line.strip()]
    assert [(r[0], r[2], r[-1] == "0.0%") for r in rows] == [("4", "off", True), ("4", "on", False)]
    assert 0 < float(rows[1][-1].rstrip("%")) < 100
    with pytest.raises(SystemExit):
        scheduler.main(["--waiting", "-1"])
