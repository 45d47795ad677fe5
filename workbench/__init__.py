"""llm-workbench: a steppable, inspectable re-implementation of vLLM's serving path.

The public names are imported lazily, so ``import workbench.kernels`` (or the CLI's
``--help``) does not pay for loading transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "workbench.entrypoints.llm",
    "LLMEngine": "workbench.engine.llm_engine",
    "EngineConfig": "workbench.config",
    "EngineArgs": "workbench.config",
    "SamplingParams": "workbench.sampling_params",
    "LoRARequest": "workbench.lora.request",
    "RequestOutput": "workbench.outputs",
    "CompletionOutput": "workbench.outputs",
    "default_model_path": "workbench.model.loader",
    "Workload": "workbench.lab.workload",
    "WorkloadRequest": "workbench.lab.workload",
    "run_workload": "workbench.lab.compare",
    "RunResult": "workbench.lab.replay",
    "replay_workload": "workbench.lab.replay",
    "compare_runs": "workbench.lab.compare",
    "Comparison": "workbench.lab.compare",
    "compare_branches": "workbench.lab.compare",
    "first_divergence": "workbench.engine.fork",
    "teaching_config": "workbench.config",
    "simulate": "workbench.lab.sim",
    "CostModel": "workbench.lab.sim",
    "sweep": "workbench.lab.sweep",
    "capacity": "workbench.lab.capacity",
    "BlockMap": "workbench.viz",
    "RequestTimeline": "workbench.viz",
    "StepPlayer": "workbench.viz",
    "EngineDashboard": "workbench.viz",
    "ComparisonView": "workbench.viz",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


def load_ipython_extension(ipython) -> None:
    """``%load_ext workbench``: register the ``%llm`` magics."""
    from workbench.entrypoints.magics import load_ipython_extension as load

    load(ipython)
