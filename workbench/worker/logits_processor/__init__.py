"""Batch-level logits processors (vLLM v1's ``LogitsProcessor``), loaded by qualified name
from ``--logits-processors`` at start-up and applied to every step's batch."""

from workbench.worker.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)
from workbench.worker.logits_processor.load import load_logits_processors
from workbench.worker.logits_processor.state import LogitsProcessors

__all__ = ["BatchUpdate", "LogitsProcessor", "LogitsProcessors", "MoveDirectionality",
           "load_logits_processors"]
