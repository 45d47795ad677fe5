"""The runner interface: what LLMEngine builds, calls and reads of the thing that executes its batches.

Declared once, here, and implemented by :class:`~workbench.worker.model_runner.ModelRunner`
(the model, its KV tensors and the sampler) and by
:class:`~workbench.lab.sim.simulated_runner.SimulatedRunner` (a cost model's predicted time,
filler tokens). The engine sizes the pool with ``determine_num_blocks``, then calls
``allocate_kv_cache`` once and ``warm_up`` once (on CUDA), then ``execute`` once per step; the
scheduler and KV cache manager never see which runner it is. Everything else the engine asks
of a runner (LoRA adapters, logits processors, sleep, the profiler's ranges, what a fork
shares) is a method here too: the engine reaches into no attribute of a runner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from workbench.core.sched.output import SchedulerOutput
    from workbench.worker.device import SimulatedDevice
    from workbench.model.model_config import ModelConfig
    from workbench.request import Request
    from workbench.worker.runner_output import RunnerOutput


@runtime_checkable
class Runner(Protocol):
    """Executes the scheduler's batches. ``batch_invariant``: whether a request's results are
    the same in any batch (shown in the engine's repr)."""

    batch_invariant: bool

    def determine_num_blocks(self, *, num_kv_blocks: int | None, kv_cache_memory_bytes: int,
                             gpu_memory_utilization: float, max_num_batched_tokens: int,
                             max_num_kv_blocks: int = 2**18) -> int:
        """How many KV blocks the pool gets: ``num_kv_blocks`` when given, else what the
        memory budget holds, at most ``max_num_kv_blocks``."""
        ...

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Make room for ``num_blocks`` blocks (called once, before any request)."""
        ...

    def warm_up(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Run the batch shapes of a serving run once before the first request (CUDA)."""
        ...

    def execute(self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request],
                grammar_bitmask: Mapping[str, torch.Tensor] | None = None) -> RunnerOutput:
        """One step's batch: a token for every scheduled request that samples (within its
        grammar's packed mask row, for constrained ones), and timings."""
        ...

    def set_logits_processors(self, processors) -> None:
        """Install the custom logits processors (ValueError for a runner that samples none)."""
        ...

    # LoRA (vLLM's add_lora / remove_lora / pin_lora / list_loras)
    def enable_lora(self, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> None: ...

    def add_lora(self, lora_request) -> bool: ...

    def remove_lora(self, lora_id: int) -> bool: ...

    def pin_lora(self, lora_id: int) -> bool: ...

    def list_loras(self) -> set[int]: ...

    # Sleep mode (vLLM's): level 1 keeps the weights in host memory, level 2 drops them
    def sleep(self, level: int) -> int:
        """Free the KV cache (and the weights, as ``level`` says); returns the bytes freed.
        ValueError for a runner that holds neither."""
        ...

    def wake_up(self, tags: list[str] | None) -> None: ...

    def is_sleeping(self) -> bool: ...

    def profile_ranges(self) -> contextlib.AbstractContextManager:
        """While entered, the runner's own stages (forward, sample) show as profiler ranges."""
        ...

    def fork_shared(self) -> list:
        """The objects an engine's fork shares with this runner (read-only: the weights)."""
        ...


class RunnerFactory(Protocol):
    """How the engine builds its runner (``LLMEngine(make_runner=...)``): the ModelRunner class
    itself, or :meth:`SimulatedRunner.factory(...) <workbench.lab.sim.simulated_runner.SimulatedRunner.factory>`.
    A factory whose runner computes nothing may name the device it stands for in a
    ``simulated_device`` attribute: it is then built with a SimulatedDevice and the engine
    imports no torch (:mod:`workbench.worker.device`)."""

    def __call__(self, model_config: ModelConfig, *, device: torch.device | SimulatedDevice, block_size: int,
                 attention_backend: str, load_format: str, seed: int, batch_invariant: bool) -> Runner:
        ...
