"""capacity(): the bracket and bisection against a runner of known capacity, the simulator's
answer re-checked run by run, the real confirmation, sweep(capacity=...) and the figure."""

import concurrent.futures
import math
import multiprocessing

import pytest
from capacity_support import knee_runner

from workbench import Workload
from workbench.lab.capacity import capacity, slo_holds
from workbench.lab.sim import CostModel, simulate
from workbench.lab.sweep import sweep

WL = Workload.poisson(24, rate=3.0, input_len=(8, 40), output_len=(4, 12), seed=3, clock="wall", text=False)
SLO = {"ttft_s_p99": 1.0}


@pytest.mark.parametrize("start, seqs, points, headroom", [(3.0, 4, 1, 0.0), (900.0, 4, 1, 0.0), (3.0, 8, 3, 0.0),
                                                           (3.0, 4, 1, 0.1), (3.0, 8, 2, 0.25)])
def test_search_brackets_and_bisects_to_the_known_capacity(start, seqs, points, headroom):
    true = 25.0 * seqs * (1 - headroom)  # see capacity_support.knee_runner: ttft_s_p99 <= 1 - headroom
    c = capacity(WL.at_rate(start), {"max_num_seqs": seqs}, SLO, run=knee_runner, points=points, rel_tol=0.02,
                 headroom=headroom, progress=False)
    assert c.bounded and c.rate <= true < c.rate * 1.02 + 1e-9
    assert c.target == {"ttft_s_p99": pytest.approx(1.0 - headroom)}
    t = c.table
    assert list(t["rate"]) == sorted(t["rate"])
    assert (t["holds"] == (t["ttft_s_p99"] <= 1.0 - headroom)).all()
    assert t.loc[t["rate"] > c.rate, "holds"].eq(False).all()
    assert t.loc[t["rate"] <= c.rate, "holds"].all()


def test_unbounded_and_impossible_slos_are_reported():
    up = capacity(WL, {"max_num_seqs": 4}, SLO, run=knee_runner, max_doublings=3, progress=False)
    assert not up.bounded and up.rate == pytest.approx(WL.rate * 8) and "a lower bound" in repr(up)
    assert "more requests would let a queue build" in repr(up)
    down = capacity(WL.at_rate(900.0), {"max_num_seqs": 4}, {"ttft_s_p99": 1e-6}, run=knee_runner,
                    max_doublings=2, progress=False)
    assert math.isnan(down.rate)
    with pytest.raises(ValueError, match="no capacity to confirm"):
        down.confirm()


def test_bad_slos_are_named():
    with pytest.raises(ValueError, match="unknown metric 'ttft_p99'"):
        capacity(WL, None, {"ttft_p99": 1.0}, progress=False)
    with pytest.raises(ValueError, match=r"slo\['tpot_s_p99'\] must be a finite number > 0"):
        capacity(WL, None, {"tpot_s_p99": -1}, progress=False)
    with pytest.raises(ValueError, match="arrives at once"):
        capacity(Workload.burst(4, clock="wall"), None, SLO, progress=False)
    with pytest.raises(ValueError, match=r"headroom must be a fraction in \[0, 1\)"):
        capacity(WL, None, SLO, headroom=1.0, progress=False)
    with pytest.raises(ValueError, match="recalibrate must be an integer >= 0"):
        capacity(WL, None, SLO, recalibrate=-1, progress=False)
    with pytest.raises(ValueError, match="cost_model and recalibrate are the simulator's"):
        capacity(WL, None, SLO, run="real", recalibrate=1, progress=False)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as ex:
        with pytest.raises(ValueError, match="this process pool forks the caller"):
            capacity(WL, None, SLO, run="real", executor=ex, progress=False)


CFG = {"block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 4}
SIM_SLO = {"ttft_s_p99": 0.02, "tpot_s_p99": 0.01}


def test_simulated_capacity_matches_fresh_simulations_at_its_edges():
    c = capacity(WL, CFG, SIM_SLO, rel_tol=0.05, headroom=0.0, progress=False)
    assert c.bounded and math.isfinite(c.rate)
    edge = c.table[c.table["rate"] > c.rate]["rate"].min()  # the lowest rate that broke
    assert edge / c.rate - 1 <= 0.05 + 1e-9
    for rate, expected in ((c.rate, True), (edge, False)):
        s = simulate(WL.at_rate(rate), CFG).summary()
        assert slo_holds(s, SIM_SLO) is expected
        row = c.table[c.table["rate"] == rate].iloc[0]
        assert row["ttft_s_p99"] == s["ttft_s_p99"] and row["tpot_s_p99"] == s["tpot_s_p99"]
    fig = c.figure()
    assert len(fig.axes) == 2 and fig.axes[0].get_ylabel() == "ttft_s_p99"


def test_confirm_runs_real_beside_the_simulation():
    small = Workload.poisson(8, rate=3.0, input_len=(8, 24), output_len=(2, 4), seed=3, clock="wall", text=False)
    c = capacity(small, CFG, {"ttft_s_p99": 0.005, "tpot_s_p99": 0.01}, rel_tol=0.5, progress=False)
    table = c.confirm(factor=1.25)
    assert list(table.index) == ["capacity", "1.25 x capacity"]
    assert table["rate"].tolist() == pytest.approx([c.rate, 1.25 * c.rate])
    for run in ("sim", "real"):
        for point, row in table.iterrows():
            held = row[f"ttft_s_p99 ({run})"] <= 0.005 and row[f"tpot_s_p99 ({run})"] <= 0.01
            assert row[f"holds ({run})"] == held
    assert table.loc["capacity", "holds (sim)"]  # the search's own answer, re-run
    assert (table["real_steps_over_model"] > 0).all() and table["real_steps_over_model"].map(math.isfinite).all()


def test_sweep_gives_each_configs_capacity():
    grid = {"max_num_seqs": [2, 4, 8]}
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        frame = sweep(WL, grid, run=knee_runner, executor=ex, capacity=SLO, progress=False)
    assert frame["error"].isna().all()
    for _, row in frame.iterrows():
        true = 25.0 * row["max_num_seqs"] * 0.9  # the default 10% headroom
        assert row["capacity_rate"] <= true < row["capacity_rate"] * 1.05 + 1e-9
        assert row["capacity_bounded"] and row["ttft_s_p99_at_capacity"] <= 0.9


def test_recalibration_searches_again_on_the_rescaled_model(monkeypatch):
    import workbench.lab.capacity as capacity_module

    shipped = CostModel.default()
    slower = shipped.scaled(2.0)
    # A stand-in machine: the first real check finds it twice as slow, the second within 5%.
    checks = iter([({"prefill_x": 2.0, "other_x": 2.0, "rescaled": True}, slower),
                   ({"prefill_x": 1.02, "other_x": 0.99, "rescaled": False}, slower.scaled(1.01))])
    monkeypatch.setattr(capacity_module, "real_check", lambda wl, cfg, slo, model: next(checks))
    plain = capacity(WL, CFG, SIM_SLO, rel_tol=0.05, progress=False)
    c = capacity(WL, CFG, SIM_SLO, rel_tol=0.05, recalibrate=3, progress=False)
    table = c.recalibrations
    assert table["rescaled"].tolist() == [True, False]  # stopped at the first check within 5%
    assert table["rate"].iloc[0] == plain.rate  # the first check is at the shipped model's answer
    assert c.cost_model is slower  # the last check's rescaling is not applied
    assert c.rate == capacity(WL, CFG, SIM_SLO, cost_model=slower, rel_tol=0.05, progress=False).rate < plain.rate
    assert table["rate"].iloc[1] == c.rate  # the second check is at the rescaled answer, which stood
    assert "2 real check(s), rescaled: prefill x2 rest x2" in repr(c) and "with 10% headroom" in repr(c)
    labels = [t.get_text() for t in c.figure().axes[0].get_legend().get_texts()]
    assert any("10% headroom" in label for label in labels)


def test_recalibration_on_the_real_engine_rescales_to_its_steps():
    small = Workload.poisson(8, rate=3.0, input_len=(8, 24), output_len=(2, 4), seed=3, clock="wall", text=False)
    slo = {"ttft_s_p99": 0.005, "tpot_s_p99": 0.01}
    c = capacity(small, CFG, slo, rel_tol=0.5, recalibrate=1, progress=False)
    (check,) = c.recalibrations.to_dict("records")
    assert set(check) == {"rate", "ttft_s_p99 (real)", "tpot_s_p99 (real)", "holds (real)", "real_steps_over_model",
                          "prefill_x", "other_x", "rescaled"}
    assert check["real_steps_over_model"] > 0 and check["prefill_x"] > 0 and check["other_x"] > 0
    assert check["rescaled"] == (abs(check["prefill_x"] - 1) > 0.05 or abs(check["other_x"] - 1) > 0.05)
    shipped = CostModel.default()
    if check["rescaled"]:
        assert c.cost_model.coefficients["prefill_tokens"] == pytest.approx(
            shipped.coefficients["prefill_tokens"] * check["prefill_x"])
        assert c.cost_model.coefficients["decode_seqs"] == pytest.approx(
            shipped.coefficients["decode_seqs"] * check["other_x"])
    else:
        assert c.cost_model == shipped
