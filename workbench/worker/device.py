"""The engine's device: a ``torch.device`` for a runner that computes, a :class:`SimulatedDevice`
for one that only predicts time.

A runner factory that computes nothing says which device it stands for with a
``simulated_device`` attribute (``SimulatedRunner.factory`` does: the device its cost model
was calibrated on). The engine then names that device without importing torch, so a
simulation starts in a fraction of a second and its schedule does not depend on whether the
machine running it has a GPU. Every other factory (``ModelRunner``) gets a ``torch.device``:
``config.device``, else CUDA when available.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SimulatedDevice:
    """The device a simulated runner stands for: ``type`` and ``index`` as a ``torch.device``'s,
    and the same ``str()`` ("cpu", "cuda:1")."""

    type: str
    index: int | None = None

    @classmethod
    def parse(cls, name: str) -> SimulatedDevice:
        """``"cpu"``, ``"cuda"`` or ``"cuda:N"``; ValueError naming ``device`` otherwise."""
        kind, _, index = str(name).partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {name!r}.")
        return cls(kind, int(index) if index else None)

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


def engine_device(name: str | None, make_runner: object) -> torch.device | SimulatedDevice:
    """The device of an engine built with ``make_runner``: ``name`` (``config.device``), else the
    factory's ``simulated_device``, else CUDA when available, else the CPU."""
    simulated = getattr(make_runner, "simulated_device", None)
    if simulated is not None:
        return SimulatedDevice.parse(name or simulated)
    import torch

    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
