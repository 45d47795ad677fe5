"""sweep() and capacity() on a Dask cluster of worker processes give the in-process results."""

import concurrent.futures
import os

import pandas as pd
import pytest
from distributed import Client, LocalCluster

from workbench import EngineConfig, Workload
from workbench.lab.capacity import capacity
from workbench.lab.sweep import run_config, sweep

WL = Workload.poisson(10, rate=3.0, input_len=(8, 40), output_len=(4, 12), seed=3, clock="wall", text=False)
CFG = {"block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 4}
SLO = {"ttft_s_p99": 0.01, "tpot_s_p99": 0.01}


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None) as cluster:
        with Client(cluster) as c:
            c.run(run_config, "sim", WL, EngineConfig(**CFG))  # both workers warm up (imports) at once
            yield c


def in_process(fn):
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return fn(ex)


def test_the_workers_are_other_processes_and_send_back_summary_rows(client):
    pids = client.run(os.getpid)
    assert len(pids) == 2 and os.getpid() not in pids.values()
    row, error = client.get_executor().submit(run_config, "sim", WL, EngineConfig(**CFG)).result()
    assert error is None and isinstance(row, dict) and all(isinstance(v, (int, float)) for v in row.values())


def test_sweep_on_dask_equals_the_in_process_sweep(client):
    grid = {"max_num_seqs": [2, 4]}
    on_dask = sweep(WL, grid, run="sim", executor=client.get_executor(), progress=False)
    here = in_process(lambda ex: sweep(WL, grid, run="sim", executor=ex, progress=False))
    pd.testing.assert_frame_equal(on_dask, here)
    assert on_dask["error"].isna().all() and on_dask["num_finished"].eq(10).all()


def test_capacity_on_dask_equals_the_in_process_search(client):
    on_dask = capacity(WL, CFG, SLO, points=2, executor=client.get_executor(), progress=False)
    here = capacity(WL, CFG, SLO, points=2, progress=False)
    assert on_dask.rate == here.rate and on_dask.bounded
    pd.testing.assert_frame_equal(on_dask.table, here.table)


def test_sweep_capacity_on_dask_equals_in_process(client):
    grid = {"max_num_seqs": [2, 8]}
    on_dask = sweep(WL, grid, base=None, executor=client.get_executor(), capacity=SLO, progress=False)
    here = in_process(lambda ex: sweep(WL, grid, executor=ex, capacity=SLO, progress=False))
    pd.testing.assert_frame_equal(on_dask, here)
    assert on_dask["capacity_rate"].notna().all()
