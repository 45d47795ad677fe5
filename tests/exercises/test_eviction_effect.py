"""The effect a passing free-block queue reports (exercise 3): with the engine's own rule in the
adapter the engine runs exactly as with its own queue; the planted wrong queues lose hits."""

from __future__ import annotations

import pytest

import workbench.exercises as ex
from workbench.exercises.eviction_effect import run

from test_eviction import HeadFirst, IgnoresHits, NewestFirst


def test_the_reference_rule_through_the_adapter_runs_as_the_engine():
    own, adapted = run(None), run(ex.reference("eviction"))
    assert own == pytest.approx(adapted, nan_ok=True)
    assert 0.3 < own["prefix_hit_rate"] < 0.7  # the prefixes do not all fit: eviction order matters


@pytest.mark.parametrize("queue", [NewestFirst, HeadFirst], ids=["newest_first", "head_first"])
def test_a_wrong_order_loses_prefix_hits(queue):
    assert run(queue)["prefix_hit_rate"] < run(None)["prefix_hit_rate"] - 0.05


def test_a_queue_that_hands_out_a_used_block_is_stopped():
    with pytest.raises(ValueError, match=r"popleft\(\) gave \d+, which is not a free block"):
        run(IgnoresHits)


def test_a_pass_reports_hit_rate_and_ttft_beside_the_reference():
    result = ex.check("eviction", ex.reference("eviction"), max_examples=5)
    assert result.passed, result.message
    yours, ref = (line.split()[1:] for line in result.message.splitlines()[-2:])
    assert "hit rate" in result.message and yours == ref and len(yours) == 3
