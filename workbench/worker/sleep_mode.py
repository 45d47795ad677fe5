"""SleepMode: a ModelRunner's memory put to sleep and woken, as vLLM's sleep levels.

* level 1: the weights go to host memory (copies on the CPU; on a CPU engine the same
  tensors, kept aside) and the KV cache is freed;
* level 2: the weights and the KV cache are both freed; waking the weights reloads them from
  the checkpoint (``load_format`` and ``seed`` as the runner was built).

Asleep, every parameter of the model holds an empty tensor and ``runner.kv_caches`` is empty;
the model's buffers (rotary tables) are kept on the CPU at both levels and put back with the
weights. ``wake_up(tags)`` wakes "weights", "kv_cache" or both (None), in any order; the runner
is awake once neither is asleep. The KV cache comes back zeroed: its contents are forgotten.
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")


def _nbytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


class SleepMode:
    """Sleep and wake-up of ``runner`` (a :class:`~workbench.worker.model_runner.ModelRunner`)."""

    def __init__(self, runner, *, load_format: str, seed: int) -> None:
        if not isinstance(getattr(runner, "model", None), torch.nn.Module) or not hasattr(runner, "kv_caches"):
            raise ValueError(f"sleep mode needs a runner with a model and a KV cache, not {type(runner).__name__}.")
        self.runner, self.load_format, self.seed = runner, load_format, seed
        self.level: int | None = None  # the level slept at; None when awake
        self.asleep: set[str] = set()
        self._weights: dict[str, torch.Tensor] = {}  # level 1: parameter name -> host copy
        self._buffers: dict[str, torch.Tensor] = {}  # buffer name -> host copy

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def sleep(self, level: int) -> int:
        """Free the model's weights and KV cache as ``level`` says; returns the bytes of tensor
        storage freed on the runner's device (on a CPU engine, less what level 1 keeps aside)."""
        model, device = self.runner.model, self.runner.device
        on_device = list(model.parameters()) + list(model.buffers()) + [t for kv in self.runner.kv_caches for t in kv]
        before = _nbytes(on_device)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                self._buffers[name] = buffer.to("cpu", copy=True)
                buffer.data = torch.empty(0, dtype=buffer.dtype, device=device)
            for name, param in model.named_parameters():
                if level == 1:  # on a CPU engine: the very tensor, kept aside
                    self._weights[name] = param.data.to("cpu")
                param.data = torch.empty(0, dtype=param.dtype, device=device)
        self.runner.kv_caches = []
        if device.type == "cuda":
            torch.cuda.empty_cache()
        self.level, self.asleep = level, set(TAGS)
        kept = _nbytes(list(self._weights.values()) + list(self._buffers.values())) if device.type == "cpu" else 0
        freed = before - _nbytes(list(model.parameters()) + list(model.buffers())) - kept
        logger.info("Sleep mode freed %.2f GiB memory, %.2f GiB memory is still in use.",
                    freed / 2**30, (before - freed) / 2**30)
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake ``tags`` (among :data:`TAGS`; None: both); a tag awake already is left alone."""
        tags = list(TAGS) if tags is None else list(tags)
        start = time.perf_counter()
        if "weights" in tags and "weights" in self.asleep:
            self._wake_weights()
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            self.runner.allocate_kv_cache(self.runner.num_blocks)
            self.asleep.discard("kv_cache")
        if not self.asleep:
            self.level = None
        logger.info("It took %.6f seconds to wake up tags %s.", time.perf_counter() - start, tags)

    def _wake_weights(self) -> None:
        from workbench.model.loader import load_model

        model, device = self.runner.model, self.runner.device
        if self.level == 2:
            fresh = load_model(self.runner.model_config, device=device, load_format=self.load_format,
                               seed=self.seed)
            self._weights = {name: p.data for name, p in fresh.named_parameters()}
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.data = self._weights.pop(name).to(device)
            for name, buffer in model.named_buffers():
                buffer.data = self._buffers.pop(name).to(device)

    def __repr__(self) -> str:
        return f"SleepMode(level={self.level}, asleep={sorted(self.asleep)})"
