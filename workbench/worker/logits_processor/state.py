"""The engine's custom logits processors and the batch they last saw: each step's rows are
compared with the previous step's to build the :class:`BatchUpdate` (a row whose request
changed is removed, then added again; vLLM's persistent batch also moves rows, this one
never does)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from workbench.request import Request
from workbench.worker.logits_processor.interface import BatchUpdate, LogitsProcessor

if TYPE_CHECKING:
    import torch


class LogitsProcessors:
    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.processors = list(processors)
        self._rows: list[Request] = []

    def __bool__(self) -> bool:
        return bool(self.processors)

    @property
    def argmax_invariant(self) -> bool:
        return all(p.is_argmax_invariant() for p in self.processors)

    def batch_update(self, requests: Sequence[Request]) -> BatchUpdate | None:
        """How this step's rows differ from the last step's (None: not at all)."""
        old, new = self._rows, list(requests)
        self._rows = new
        changed = [i for i in range(max(len(old), len(new)))
                   if i >= len(old) or i >= len(new) or old[i] is not new[i]]
        if not changed:
            return None
        removed = [i for i in changed if i < len(old)]
        added = [(i, new[i].sampling_params, new[i].prompt_token_ids, new[i].output_token_ids)
                 for i in changed if i < len(new)]
        return BatchUpdate(batch_size=len(new), removed=removed, added=added, moved=[])

    def update_state(self, requests: Sequence[Request]) -> None:
        """Tell every processor how the batch changed (call once per sampling step)."""
        update = self.batch_update(requests)
        for processor in self.processors:
            processor.update_state(update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for processor in self.processors:
            logits = processor.apply(logits)
        return logits
