"""vLLM v1's LogitsProcessor interface: one instance per engine sees the whole batch.

Before each sampling step ``update_state`` learns how the batch changed (a
:class:`BatchUpdate`, or None when it did not), to be read in the order removed, added,
moved; ``apply`` then gets the batch's logits ``[num_rows, vocab]`` (row i is the batch's
request i) and returns them, changed in place or not. A request's own settings reach its
processor through ``SamplingParams.extra_args`` (``vllm_xargs`` over HTTP), checked by
``validate_params`` when the request is added.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

from workbench.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # the request at i1 moves to i2
    SWAP = auto()  # the requests at i1 and i2 trade places


RemovedRequest = int
#: (batch index, params, prompt token ids, output token ids): the output list is the
#: request's own, so a processor that keeps it sees every new token.
AddedRequest = tuple[int, SamplingParams, list[int], list[int]]
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError for parameters this processor refuses (the request is a 400)."""

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        """``vllm_config``: the engine's EngineConfig."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The batch's logits, processed."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if this processor never changes a row's argmax (greedy rows may skip it)."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before each step's ``apply``; ``batch_update`` is None when the batch's
        requests are those of the previous step, in the same rows."""
