"""sweep(): grid expansion, ordering across executors, error rows, the real engine; the Pareto front."""

from __future__ import annotations

import concurrent.futures
import math
import multiprocessing
import time

import numpy as np
import pandas as pd
import pytest

from workbench import Workload, run_workload, teaching_config
from workbench.lab.sweep import expand_grid, sweep
from workbench.viz.pareto import pareto_figure, pareto_front


# ------------------------------------------------------------------ grids
def test_dict_grid_is_the_cartesian_product_last_key_fastest():
    grid = {"policy": ["fcfs", "spf"], "num_kv_blocks": [16, 32, 64]}
    assert expand_grid(grid) == [
        {"policy": "fcfs", "num_kv_blocks": 16}, {"policy": "fcfs", "num_kv_blocks": 32},
        {"policy": "fcfs", "num_kv_blocks": 64}, {"policy": "spf", "num_kv_blocks": 16},
        {"policy": "spf", "num_kv_blocks": 32}, {"policy": "spf", "num_kv_blocks": 64},
    ]


def test_grid_values_may_be_ranges_and_numpy_arrays_of_python_numbers():
    configs = expand_grid({"max_num_seqs": range(1, 3), "num_kv_blocks": np.array([8, 16])})
    assert configs == [{"max_num_seqs": 1, "num_kv_blocks": 8}, {"max_num_seqs": 1, "num_kv_blocks": 16},
                       {"max_num_seqs": 2, "num_kv_blocks": 8}, {"max_num_seqs": 2, "num_kv_blocks": 16}]
    assert all(type(c["num_kv_blocks"]) is int for c in configs)
    assert type(expand_grid([{"block_size": np.int64(8)}])[0]["block_size"]) is int


def test_list_grid_keeps_its_order():
    grid = [{"block_size": 8}, {"policy": "priority", "max_num_seqs": 2}, {}]
    assert expand_grid(grid) == grid


@pytest.mark.parametrize(
    "grid, message",
    [
        ({"policy": ["fcfs"], "num_blocks": [1], "budget": [2]}, r"unknown EngineConfig field\(s\) \['budget', 'num_blocks'\]"),
        ([{"policy": "spf"}, {"max_seqs": 2}], r"unknown EngineConfig field\(s\) \['max_seqs'\]"),
        ({"policy": "fcfs"}, r"grid\['policy'\] must be a non-empty list"),
        ({"policy": []}, r"grid\['policy'\] must be a non-empty list"),
        ({"num_kv_blocks": 8}, r"grid\['num_kv_blocks'\] must be a non-empty list"),
        ([], "grid is empty"),
        ([{"policy": "spf"}, "fcfs"], r"grid\[1\] must be a dict"),
        ("policy", "grid must be a dict of lists or a list of dicts"),
    ],
)
def test_bad_grids_are_named(grid, message):
    with pytest.raises(ValueError, match=message):
        expand_grid(grid)


# ------------------------------------------------------- a fake runner
class FakeResult:
    """Stands in for a RunResult: a summary that depends on the config."""

    def __init__(self, config):
        self.config = config

    def summary(self):
        return {"blocks_x2": 2 * self.config.num_kv_blocks, "seqs": self.config.max_num_seqs}


def slow_first_runner(workload, config):
    """Finishes the first configurations last, so completion order is the reverse of grid order;
    fails for num_kv_blocks == 13."""
    time.sleep(0.05 * (64 - config.num_kv_blocks) / 16)
    if config.num_kv_blocks == 13:
        raise RuntimeError("pool of 13 refused")
    return FakeResult(config)


WORKLOAD = Workload.poisson(num_requests=3, rate=2.0, input_len=(6, 12), output_len=(2, 4), seed=5)


@pytest.mark.parametrize(
    "make_executor",
    [lambda: concurrent.futures.ProcessPoolExecutor(2), lambda: concurrent.futures.ThreadPoolExecutor(3)],
    ids=["processes", "threads"],
)
def test_rows_in_grid_order_and_a_failing_config_gets_an_error_row(make_executor):
    grid = {"max_num_seqs": [2, 3], "num_kv_blocks": [16, 13, 64]}
    with make_executor() as executor:
        frame = sweep(WORKLOAD, grid, run=slow_first_runner, base=teaching_config(), executor=executor,
                      progress=False)
    assert list(frame.columns) == ["max_num_seqs", "num_kv_blocks", "blocks_x2", "seqs", "error"]
    assert frame.attrs["config_columns"] == ["max_num_seqs", "num_kv_blocks"]
    assert frame[["max_num_seqs", "num_kv_blocks"]].values.tolist() == [[2, 16], [2, 13], [2, 64],
                                                                         [3, 16], [3, 13], [3, 64]]
    ok = frame["error"].isna()
    assert ok.tolist() == [True, False, True, True, False, True]
    assert (frame.loc[ok, "blocks_x2"] == 2 * frame.loc[ok, "num_kv_blocks"]).all()
    assert (frame.loc[ok, "seqs"] == frame.loc[ok, "max_num_seqs"]).all()
    assert frame.loc[~ok, "blocks_x2"].isna().all()
    assert set(frame.loc[~ok, "error"]) == {"RuntimeError: pool of 13 refused"}


def test_list_grid_fills_unset_columns_from_the_base():
    grid = [{"num_kv_blocks": 16}, {"num_kv_blocks": 64, "max_num_seqs": 3}]
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        frame = sweep(WORKLOAD, grid, run=slow_first_runner, base=teaching_config(max_num_seqs=4),
                      executor=executor, progress=False)
    assert frame[["num_kv_blocks", "max_num_seqs", "seqs"]].values.tolist() == [[16, 4, 4], [64, 3, 3]]


def test_bad_configs_fail_before_anything_runs():
    calls = []

    def runner(workload, config):
        calls.append(config)
        return FakeResult(config)

    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        with pytest.raises(ValueError, match=r"unknown EngineConfig field\(s\) \['pool'\]"):
            sweep(WORKLOAD, [{"num_kv_blocks": 8}, {"pool": 3}], run=runner, executor=executor, progress=False)
        with pytest.raises(ValueError, match=r"grid configuration 1 \{'block_size': 0\}: block_size must be >= 1"):
            sweep(WORKLOAD, {"block_size": [4, 0]}, run=runner, executor=executor, progress=False)
        with pytest.raises(ValueError, match="run must be one of"):
            sweep(WORKLOAD, {"block_size": [4]}, run="fast", executor=executor, progress=False)
        with pytest.raises(ValueError, match="max_workers must be an integer >= 1"):
            sweep(WORKLOAD, {"block_size": [4]}, run=runner, max_workers=0, progress=False)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as executor:
        with pytest.raises(ValueError, match="this process pool forks the caller.*forkserver"):
            sweep(WORKLOAD, {"block_size": [4]}, run="real", executor=executor, progress=False)
    assert calls == []


def test_real_runs_in_the_default_process_pool_match_run_workload():
    workload = Workload.poisson(num_requests=5, rate=3.0, input_len=(10, 30), output_len=(3, 8), seed=2)
    grid = {"policy": ["fcfs", "spf"], "num_kv_blocks": [12]}
    base = teaching_config()
    frame = sweep(workload, grid, run="real", base=base, max_workers=2, progress=False)
    assert frame["error"].isna().all(), frame["error"].tolist()
    # The step clock makes every step-based number reproducible (the *_s ones are wall times).
    step_columns = ["num_requests", "num_finished", "num_steps", "output_tokens", "throughput_tok_step",
                    "num_preemptions", "num_recomputed_tokens", "prefix_hit_rate",
                    *[f"{m}_p{p}" for m in ("ttft_steps", "tpot_steps", "e2e_steps") for p in (50, 90, 99)]]
    for _, row in frame.iterrows():
        expected = run_workload(workload, teaching_config(policy=row["policy"], num_kv_blocks=12)).summary()
        got = {c: row[c] for c in step_columns}
        assert got == pytest.approx({c: expected[c] for c in step_columns}, nan_ok=True)
        assert row["throughput_tok_s"] > 0


# ------------------------------------------------------------ Pareto front
def _frame():
    # x: p99 TTFT (lower better), y: throughput (higher better). Worked by hand:
    # a (1, 10) front; b (2, 10) dominated by a; c (2, 20) front; d (2, 20) front (tie with c);
    # e (3, 15) dominated by c; f (4, 30) front; g (NaN) failed; h (5, 30) dominated by f.
    frame = pd.DataFrame({
        "policy": ["fcfs", "fcfs", "spf", "spf", "fcfs", "priority", "spf", "fcfs"],
        "num_kv_blocks": [16, 32, 16, 32, 64, 64, 8, 128],
        "block_size": [16] * 8,
        "ttft_s_p99": [1.0, 2.0, 2.0, 2.0, 3.0, 4.0, math.nan, 5.0],
        "throughput_tok_s": [10.0, 10.0, 20.0, 20.0, 15.0, 30.0, math.nan, 30.0],
    }, index=list("abcdefgh"))
    frame.attrs["config_columns"] = ["policy", "num_kv_blocks", "block_size"]
    return frame


def test_pareto_front_by_hand():
    assert list(pareto_front(_frame()).index) == ["a", "c", "d", "f"]


def test_pareto_front_directions_and_bad_columns():
    frame = _frame()
    # Higher x better, lower y better: h (5, 30) beats f; e (3, 15)... worked by hand:
    # best x is h (5); nothing with x > 5; then y must strictly improve (drop) as x worsens:
    # f (4, 30) no; e (3, 15) yes; c, d (2, 20) no; b (2, 10) yes; a (1, 10) no.
    front = pareto_front(frame, x_better="higher", y_better="lower")
    assert list(front.index) == ["h", "e", "b"]
    with pytest.raises(ValueError, match="x='ttft_p99' is not a column"):
        pareto_front(frame, x="ttft_p99")
    with pytest.raises(ValueError, match="y_better must be one of"):
        pareto_front(frame, y_better="more")


def test_pareto_figure_highlights_and_labels_the_front():
    figure = pareto_figure(_frame())
    ax = figure.axes[0]
    (front_line,) = ax.get_lines()
    assert list(front_line.get_xdata()) == [1.0, 2.0, 2.0, 4.0]
    assert list(front_line.get_ydata()) == [10.0, 20.0, 20.0, 30.0]
    # Labels name only the config columns that vary (block_size is constant).
    assert [t.get_text() for t in ax.texts] == [
        "policy=fcfs, num_kv_blocks=16", "policy=spf, num_kv_blocks=16",
        "policy=spf, num_kv_blocks=32", "policy=priority, num_kv_blocks=64",
    ]
    assert ax.get_title() == "4 of 7 configs on the Pareto front (1 without ttft_s_p99 / throughput_tok_s)"
    assert len(ax.collections[0].get_offsets()) == 7
    figure.canvas.draw()
