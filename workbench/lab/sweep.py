"""sweep(): one workload under many engine configurations, in parallel, as one DataFrame.

A grid is either a dict of lists -- every combination, the last key varying fastest
(``{"policy": ["fcfs", "spf"], "num_kv_blocks": [64, 128]}`` gives four configurations) --
or a list of dicts, each one configuration. Every configuration is a dict of
:class:`~workbench.config.EngineConfig` overrides on ``base``; all of them are checked
before anything runs. Each run is on the workload's own clock, as ``run_workload`` and
``simulate`` are (:mod:`workbench.lab.workload`).

Each configuration runs in a worker of a ``concurrent.futures`` executor (a process pool by
default; a Dask ``distributed.Client(...).get_executor()`` works unchanged, tested with a local
cluster of worker processes). A task carries
the workload and one resolved config -- the default pool hands each worker the workload once,
when it starts, and its tasks carry only the config -- and sends back only the run's summary
row, never its history. The default pool starts its workers from a fresh interpreter
("forkserver", or "spawn" where there is none), never by forking the caller: a forked child
of a process whose torch already ran OpenMP threads hangs in its first parallel op (so
``run="real"`` on a given process pool that forks is refused with that advice). So a
``run`` callable must be importable from a module (not defined in a notebook cell), as with
any such pool. Rows come back in grid order whatever the completion order; a configuration that
raises gets its error (``"TypeName: message"``) in the ``error`` column and NaN metrics, and
the others go on.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import math
import multiprocessing
import os
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from workbench.config import EngineConfig
from workbench.lab.capacity import capacity_row, check_slo
from workbench.lab.run import resolve_config
from workbench.lab.runners import Runner, check_executor, resolve_runner
from workbench.lab.workload import Workload
from workbench.utils.errors import describe


def expand_grid(grid: Mapping[str, Iterable] | Sequence[Mapping[str, object]]) -> list[dict]:
    """The configurations of ``grid``, in a stable order (see the module docstring).

    A dict's values may be any non-empty iterable (a list, a range, a numpy array); numpy
    scalars become Python numbers. Raises ValueError for an empty grid, a dict entry that is
    not a non-empty collection of values, or keys that are not EngineConfig fields (all of
    them named)."""
    if isinstance(grid, Mapping):
        axes = []
        for key, values in grid.items():
            if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
                raise ValueError(f"grid[{key!r}] must be a non-empty list of values, got {values!r}.")
            values = [_python_scalar(v) for v in values]
            if not values:
                raise ValueError(f"grid[{key!r}] must be a non-empty list of values, got [].")
            axes.append(values)
        configs = [dict(zip(grid, combo)) for combo in itertools.product(*axes)]
    elif isinstance(grid, Sequence) and not isinstance(grid, (str, bytes)):
        configs = []
        for i, config in enumerate(grid):
            if not isinstance(config, Mapping):
                raise ValueError(f"grid[{i}] must be a dict of EngineConfig overrides, got {type(config).__name__}.")
            configs.append({key: _python_scalar(v) for key, v in config.items()})
    else:
        raise ValueError(f"grid must be a dict of lists or a list of dicts, got {type(grid).__name__}.")
    if not configs:
        raise ValueError("grid is empty: give at least one configuration.")
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted({key for config in configs for key in config} - known)
    if unknown:
        raise ValueError(f"grid: unknown EngineConfig field(s) {unknown}; known: {sorted(known)}.")
    return configs


def sweep(
    workload: Workload,
    grid: Mapping[str, Iterable] | Sequence[Mapping[str, object]],
    *,
    run: str | Runner = "sim",
    base: EngineConfig | None = None,
    executor: concurrent.futures.Executor | None = None,
    max_workers: int | None = None,
    progress: bool = True,
    capacity: Mapping[str, float] | None = None,
):
    """Run ``workload`` under every configuration of ``grid`` and return a pandas DataFrame:
    one row per configuration, in grid order, with the override columns, then
    ``RunResult.summary()``'s columns, then ``error`` (None when the run succeeded).
    ``capacity=slo`` (e.g. ``{"ttft_s_p99": 0.5}``): each configuration's capacity under that
    SLO instead of one run (:func:`workbench.lab.capacity.capacity`, searched inside its
    worker): the columns of :func:`~workbench.lab.capacity.capacity_row`.

    ``run``: ``"sim"`` (:func:`workbench.lab.sim.simulate`), ``"real"``
    (:func:`workbench.lab.run.run_real`) or a picklable ``callable(workload, config) ->
    RunResult``. ``executor``: any ``concurrent.futures.Executor``; by default a
    ``ProcessPoolExecutor`` of ``max_workers`` (default ``os.cpu_count()``) fresh processes
    (see the module docstring), created and shut down here. ``progress``: a tqdm bar over
    finished configurations.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    if not isinstance(workload, Workload):
        raise ValueError(f"workload must be a Workload, got {type(workload).__name__}.")
    if max_workers is not None and (not isinstance(max_workers, int) or max_workers < 1):
        raise ValueError(f"max_workers must be an integer >= 1, got {max_workers!r}.")
    overrides = expand_grid(grid)
    configs = []
    for i, config in enumerate(overrides):
        try:
            configs.append(resolve_config(config, base))
        except (TypeError, ValueError) as e:
            raise ValueError(f"grid configuration {i} {config}: {e}") from None
    resolve_runner(run)  # fail here, not once per configuration, on a bad ``run``
    if capacity is not None:
        capacity = check_slo(capacity)
    check_executor(run, executor)

    own_executor = executor is None
    if own_executor:
        workers = min(len(configs), max_workers or os.cpu_count() or 1)
        executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=workers, mp_context=_fresh_interpreter_context(),
            initializer=_install_workload, initargs=(workload,),
        )
    summaries: list[dict | None] = [None] * len(configs)
    errors: list[str | None] = [None] * len(configs)
    try:
        if own_executor:
            futures = {executor.submit(_run_installed, run, c, capacity): i for i, c in enumerate(configs)}
        else:
            futures = {executor.submit(run_config, run, workload, c, capacity): i for i, c in enumerate(configs)}
        bar = tqdm(total=len(futures), desc="configs", unit="config", disable=not progress)
        with bar:
            for future in concurrent.futures.as_completed(futures):
                i = futures[future]
                try:
                    summaries[i], errors[i] = future.result()
                except Exception as e:  # the executor's own failure (a dead worker, pickling)
                    errors[i] = describe(e)
                bar.update(1)
    finally:
        if own_executor:
            executor.shutdown(cancel_futures=True)

    config_columns = list(dict.fromkeys(key for config in overrides for key in config))
    metric_columns = list(dict.fromkeys(key for s in summaries if s for key in s))
    rows = [
        {
            **{key: config.get(key, getattr(resolved, key)) for key in config_columns},
            **{key: (s or {}).get(key, math.nan) for key in metric_columns},
            "error": error,
        }
        for config, resolved, s, error in zip(overrides, configs, summaries, errors)
    ]
    frame = pd.DataFrame(rows, columns=[*config_columns, *metric_columns, "error"])
    frame.attrs["config_columns"] = config_columns
    return frame


def run_config(run: str | Runner, workload: Workload, config: EngineConfig,
               capacity: Mapping[str, float] | None = None) -> tuple[dict | None, str | None]:
    """One configuration, in a worker: ``(summary row, None)`` -- of its run, or of its
    capacity search under the SLO ``capacity`` -- or ``(None, error)`` when it raised (the
    error as text, so that any exception crosses a process boundary)."""
    try:
        if capacity is not None:
            return capacity_row(run, workload, config, capacity), None
        return dict(resolve_runner(run)(workload, config).summary()), None
    except Exception as e:
        return None, describe(e)


#: The workload of this worker process of sweep()'s own pool (set once, when it starts).
_installed_workload: Workload | None = None


def _install_workload(workload: Workload) -> None:
    global _installed_workload
    _installed_workload = workload


def _run_installed(run: str | Runner, config: EngineConfig, capacity=None) -> tuple[dict | None, str | None]:
    return run_config(run, _installed_workload, config, capacity)


def _fresh_interpreter_context() -> multiprocessing.context.BaseContext:
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


def _python_scalar(value):
    """A numpy scalar as the Python number it holds (EngineConfig wants ints, not int64)."""
    return value.item() if isinstance(value, np.generic) else value

