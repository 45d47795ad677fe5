"""Custom logits processors for the tests, loaded by qualified name as the server loads them
(``logits_processor_support:ForceTokens``): tests/ is on the path."""

from __future__ import annotations

import torch

from workbench.worker.logits_processor import BatchUpdate, LogitsProcessor


class ForceTokens(LogitsProcessor):
    """A request with ``extra_args={"force": [ids]}`` writes those tokens first; the other
    rows, and the same row afterwards, are left alone."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.rows: dict[int, tuple[list[int], list[int]]] = {}  # index: (ids, output ids)

    @classmethod
    def validate_params(cls, sampling_params):
        force = (sampling_params.extra_args or {}).get("force")
        if force is not None and not (isinstance(force, list) and all(
                isinstance(t, int) for t in force)):
            raise ValueError(f"extra_args.force must be a list of token ids, got {force!r}.")

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            force = (params.extra_args or {}).get("force")
            if force:
                self.rows[index] = (force, output_ids)

    def apply(self, logits):
        for index, (force, output_ids) in self.rows.items():
            if len(output_ids) < len(force):
                logits[index] = -float("inf")
                logits[index, force[len(output_ids)]] = 0.0
        return logits


class RecordUpdates(LogitsProcessor):
    """Keeps every BatchUpdate it is given (None included); changes nothing."""

    updates: list = []

    def __init__(self, vllm_config, device, is_pin_memory):
        RecordUpdates.updates = []

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        RecordUpdates.updates.append(batch_update)

    def apply(self, logits):
        return logits


class NotAProcessor:
    pass


def force_args(tokenizer, text: str) -> dict:
    return {"force": tokenizer.encode(text, add_special_tokens=False)}


def forcing(ids):
    """A per-request logits processor (``SamplingParams.logits_processors``) that makes the
    request write ``ids`` first, then leaves the logits alone."""
    def force(output_ids, logits):
        if len(output_ids) < len(ids):
            logits = torch.full_like(logits, -float("inf"))
            logits[ids[len(output_ids)]] = 0.0
        return logits
    return force


def unused(x: torch.Tensor) -> torch.Tensor:  # a loadable name that is not a class
    return x
