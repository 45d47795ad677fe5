"""The effect a passing schedule() reports (exercises 1 and 4): the batch-level loop's times
worked out by hand with a cost model of one second per step, and the table on success."""

from __future__ import annotations

import pytest

import workbench.exercises as ex
from workbench.exercises.batch_effect import EffectWorkload, _Req, drive
from workbench.lab.sim.cost_model import CostModel

ONE_SECOND_A_STEP = CostModel(coefficients={"step": 1.0})


class Two(EffectWorkload):
    """r0 (prompt 10, 3 tokens) at 0 and r1 (prompt 2, 2 tokens) at 0.5; budget 4."""

    def requests(self):
        return [_Req("r0", 0.0, 10, 3, 10, 0, []), _Req("r1", 0.5, 2, 2, 2, 0, [])]


def test_the_loop_times_chunked_prefill_as_worked_by_hand():
    # steps end at 1, 2, 3, ...: r0 4 | r0 4, r1 waits behind the budget | r0 2 (first token at 3),
    # r1 2 (first token at 3) | r0 1, r1 1 (tokens at 4) | r0 1 (its third token at 5).
    m = drive(ex.reference("chunked_prefill"), Two(max_num_batched_tokens=4, max_num_seqs=2), ONE_SECOND_A_STEP)
    assert m["ttft_p50"] == pytest.approx(1e3 * (3.0 + 2.5) / 2)  # r0 3 s, r1 2.5 s
    assert m["tpot_p50"] == pytest.approx(1e3 * 1.0)


def test_a_stalled_schedule_is_named():
    with pytest.raises(ValueError, match="step 0: the batch {} schedules nothing"):
        drive(lambda running, waiting, budget, seqs: [], Two(), ONE_SECOND_A_STEP)


@pytest.mark.parametrize("name", ["admission", "chunked_prefill"])
def test_a_pass_reports_ttft_and_tpot_beside_the_reference(name):
    result = ex.check(name, ex.reference(name), max_examples=5)
    assert result.passed, result.message
    yours, ref = (line.split()[1:] for line in result.message.splitlines()[-2:])
    assert "TTFT p50" in result.message and yours == ref and len(yours) == 4


def test_a_schedule_that_cannot_split_says_so_in_the_chunked_table():
    from workbench.exercises.batch_effect import EFFECT_WORKLOADS, effect_table

    table = effect_table(ex.reference("admission"), ex.reference("chunked_prefill"), EFFECT_WORKLOADS[True])
    assert "yours      could not run: ValueError" in table and "chunked prefill is disabled" in table


@pytest.mark.parametrize("chunked", [False, True], ids=["admission", "chunked_prefill"])
def test_the_loop_times_the_reference_as_the_engine_simulator_does(chunked):
    # The real engine (scheduler, KV cache, simulated runner) on the same requests: the loop
    # leaves out the engine's wake-up cost after idling, so it agrees within a few percent.
    from workbench.exercises.batch_effect import EFFECT_WORKLOADS
    from workbench.lab.sim.simulate import simulate
    from workbench.lab.workload import Workload, WorkloadRequest
    from workbench.sampling_params import SamplingParams

    w = EFFECT_WORKLOADS[chunked]
    workload = Workload([WorkloadRequest(r.request_id, (7,) * r.num_prompt_tokens,
                                         SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, detokenize=False),
                                         arrival_time=r.arrival) for r in w.requests()], clock="wall")
    engine = simulate(workload, {"block_size": 16, "num_kv_blocks": 2000, "max_model_len": 256,
                                 "max_num_batched_tokens": w.max_num_batched_tokens, "max_num_seqs": w.max_num_seqs,
                                 "enable_chunked_prefill": chunked, "enable_prefix_caching": False,
                                 "keep_warm_s": 0.0}).summary()
    loop = drive(ex.reference("chunked_prefill" if chunked else "admission"), w)
    for metric in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"):
        name, p = metric.split("_")
        assert loop[metric] == pytest.approx(1e3 * engine[f"{name}_s_{p}"], rel=0.08), metric
