"""A workload on a fresh engine built from a configuration: resolve_config and run_real.

``run_real(workload, config)`` is ``run_workload``'s real path (no simulation): an
:class:`~workbench.engine.llm_engine.LLMEngine` built from ``config`` and driven through the
workload by :func:`workbench.lab.replay.drive`, which returns the
:class:`~workbench.lab.replay.RunResult`. The simulator (:mod:`workbench.lab.sim`) builds
its engines with the same ``resolve_config``.
"""

from __future__ import annotations

import dataclasses
import functools

from workbench.config import EngineConfig
from workbench.engine.llm_engine import LLMEngine
from workbench.lab.replay import RunResult, RunSource, drive, run_clock
from workbench.lab.workload import Workload


def resolve_config(config: EngineConfig | dict | None, base: EngineConfig | None = None) -> EngineConfig:
    """An EngineConfig from one, from a dict of overrides on ``base`` (default
    ``EngineConfig()``), or ``base`` itself for None. Unknown fields raise ValueError."""
    base = base or EngineConfig()
    if config is None:
        return base
    if isinstance(config, EngineConfig):
        return config
    if isinstance(config, dict):
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown EngineConfig field(s) {unknown}; known: {sorted(known)}.")
        return dataclasses.replace(base, **config)
    raise ValueError(f"config must be an EngineConfig, a dict of overrides or None, got {type(config).__name__}.")


def run_real(workload: Workload, config: EngineConfig | dict | None = None, *, clock: str | None = None,
             progress: bool = False) -> RunResult:
    """``workload`` on a fresh engine built from ``config`` (see :func:`resolve_config`), on the
    workload's clock (``clock``, when given, must be it), until every request finished; the
    engine's own history and request tracker become the result's. The result's ``source``
    builds the same engine again (:meth:`~workbench.lab.replay.RunResult.fork_at`)."""
    config = resolve_config(config)
    clock = run_clock(workload, clock)
    source = RunSource(functools.partial(LLMEngine, config), workload, clock, exact=clock == "steps")
    return drive(source.make_engine(), workload, clock=clock, progress=progress, exclusive=True, source=source)
