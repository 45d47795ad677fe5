"""The runs a sweep or a capacity search can make of one configuration: by name or a callable.

``"sim"`` is :func:`workbench.lab.sim.simulate` (shipped cost model), ``"real"`` is
:func:`workbench.lab.run.run_real`; any picklable ``callable(workload, config) -> RunResult``
works too (a top-level function, or ``functools.partial(simulate, cost_model=...)``), so that
process pools and Dask workers can run it.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Callable

from workbench.config import EngineConfig
from workbench.lab.run import run_real
from workbench.lab.sim.simulate import simulate
from workbench.lab.workload import Workload

#: ``run`` names: the simulated runner and the real engine.
RUNS = ("sim", "real")

Runner = Callable[[Workload, EngineConfig], object]  # -> RunResult


def resolve_runner(run: str | Runner) -> Runner:
    """The callable ``run`` names; ValueError for anything else."""
    if run == "sim":
        return simulate
    if run == "real":
        return run_real
    if callable(run):
        return run
    raise ValueError(f"run must be one of {RUNS} or a callable(workload, config) -> RunResult, got {run!r}.")


def check_executor(run: str | Runner, executor) -> None:
    """ValueError for real runs on a process pool that forks the caller: a forked copy of a
    process whose torch already ran threads hangs in the real engine's first parallel op."""
    if run == "real" and _forks(executor):
        raise ValueError("executor: this process pool forks the caller, and a forked copy of a process whose "
                         "torch already ran threads hangs in the real engine's first parallel op; give it "
                         "mp_context=multiprocessing.get_context('forkserver') (or 'spawn'), or leave "
                         "executor=None.")


def _forks(executor) -> bool:
    """Whether ``executor`` is a ProcessPoolExecutor that starts its workers by forking (the
    default start method on Linux before Python 3.14)."""
    if not isinstance(executor, concurrent.futures.ProcessPoolExecutor):
        return False
    context = getattr(executor, "_mp_context", None) or multiprocessing.get_context()
    return context.get_start_method() == "fork"
