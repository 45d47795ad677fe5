"""SleepMode: a ModelRunner's memory put to sleep and woken, as vLLM's sleep levels.

* level 1: the weights go to host memory (copies on the CPU; on a CPU engine the same
  tensors, kept aside) and the KV cache is freed;
* level 2: the weights and the KV cache are both freed; waking the weights reloads them from
  the checkpoint into the model's own parameters (``load_format`` and ``seed`` as the runner
  was built; a LoRA-wrapped model too).

Asleep, every parameter of the model holds an empty tensor (and its oneDNN copies,
``kernels/cpu_linear.py``, are freed) and ``runner.kv_caches`` is empty;
the model's buffers (rotary tables) are kept on the CPU at both levels and put back with the
weights. ``wake_up(tags)`` wakes "weights", "kv_cache" or both (None), in any order; the runner
is awake once neither is asleep. The KV cache comes back zeroed: its contents are forgotten.

Sleep rebinds the runner's own tensor objects and never writes their storage, so what it
frees is the storage no other tensor holds any more: weights an engine's fork shares stay
(for the other engine; see :mod:`workbench.engine.fork`), and a fork that slept wakes with
weights of its own (level 1 on a GPU, level 2) or the very ones it kept (level 1 on a CPU).
"""

from __future__ import annotations

import logging
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from workbench.model.loader import load_weights

logger = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")


def _storages(tensors) -> dict[int, tuple[StorageWeakRef, int]]:
    """Each non-empty storage behind ``tensors``, by address: a weak reference and its bytes."""
    return {s.data_ptr(): (StorageWeakRef(s), s.nbytes())
            for s in (t.untyped_storage() for t in tensors) if s.nbytes()}


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
        self._shapes: dict[str, torch.Size] = {}  # parameter name -> its shape awake

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def sleep(self, level: int) -> int:
        """Free the model's weights and KV cache as ``level`` says; returns the bytes of tensor
        storage freed on the runner's device: the storage no tensor holds any more (not what
        level 1 keeps aside on a CPU engine, nor weights a fork of the engine shares)."""
        model, device = self.runner.model, self.runner.device
        held = _storages([*model.parameters(), *model.buffers(), *(t for kv in self.runner.kv_caches for t in kv)])
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                self._buffers[name] = buffer.data.to("cpu")
                buffer.data = torch.empty(0, dtype=buffer.dtype, device=device)
            for name, param in model.named_parameters():
                self._shapes[name] = param.shape
                if level == 1:  # on a CPU engine: the very storage, kept aside
                    self._weights[name] = param.data.to("cpu")
                param.data = torch.empty(0, dtype=param.dtype, device=device)
        model.release_packed_weights()
        self.runner.kv_caches = []
        if device.type == "cuda":
            torch.cuda.empty_cache()
        self.level, self.asleep = level, set(TAGS)
        freed = sum(nbytes for ref, nbytes in held.values() if ref.expired())
        logger.info("Sleep mode freed %.2f GiB memory, %.2f GiB memory is still in use.",
                    freed / 2**30, (sum(nbytes for _, nbytes in held.values()) - freed) / 2**30)
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
        model, device = self.runner.model, self.runner.device
        with torch.no_grad():
            for name, param in model.named_parameters():
                if self.level == 2:  # the checkpoint, read into the model's own parameters
                    param.data = torch.empty(self._shapes[name], dtype=param.dtype, device=device)
                else:
                    param.data = self._weights.pop(name).to(device)
            if self.level == 2:
                load_weights(model, self.runner.model_config, load_format=self.load_format, seed=self.seed)
            for name, buffer in model.named_buffers():
                buffer.data = self._buffers.pop(name).to(device)

    def __repr__(self) -> str:
        return f"SleepMode(level={self.level}, asleep={sorted(self.asleep)})"
