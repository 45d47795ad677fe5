"""The pooler: a pooling request's final normed hidden states -> its embedding (vLLM's
LAST / MEAN / CLS / ALL pooling, matryoshka ``dimensions``, L2 ``normalize``).

A prompt may be computed over several steps (chunked prefill): LAST reads only the chunk
that ends the prompt; MEAN, CLS and ALL keep each chunk's rows until then. Those three need
every prompt position computed here, so a request of theirs must not start from prefix-cache
hits (``PoolingParams.skip_reading_prefix_cache``); one that does fails, never a wrong vector.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F

from workbench.core.sched.output import SchedulerOutput
from workbench.pooling_params import PoolingParams
from workbench.request import Request
from workbench.utils.errors import describe

logger = logging.getLogger("workbench")


def pool_hidden_states(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """One prompt's ``[tokens, hidden]`` states pooled: the last row, the mean, the first
    row (CLS), or all rows (ALL)."""
    if pooling_type == "LAST":
        return hidden[-1]
    if pooling_type == "MEAN":
        return hidden.mean(dim=0)
    if pooling_type == "CLS":
        return hidden[0]
    if pooling_type == "ALL":
        return hidden
    raise ValueError(f"pooling_type must be LAST, MEAN, CLS or ALL, got {pooling_type!r}.")


def finish_pooled(data: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Matryoshka truncation to ``dimensions`` (first), then L2 normalization (``normalize``),
    in float32 on the CPU."""
    data = data.float()
    if params.dimensions is not None:
        data = data[..., : params.dimensions]
    if params.normalize:
        data = F.normalize(data, p=2, dim=-1)
    return data.cpu()


class Pooler:
    """Pools the pooling requests whose prompt a step completes (see the module docstring).

    Invariant: ``_partial[id]`` holds the rows of positions ``0 .. n-1`` of a MEAN / CLS / ALL
    request whose ``num_computed_tokens`` is ``n``."""

    def __init__(self) -> None:
        self._partial: dict[str, list[torch.Tensor]] = {}

    def __call__(self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request],
                 hidden: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(pooled data by request id, failures by request id: the ``describe``d error)."""
        pooled: dict[str, torch.Tensor] = {}
        failed: dict[str, str] = {}
        offset = 0
        for chunk in scheduler_output.scheduled:
            rid, n = chunk.request_id, chunk.num_new_tokens
            params = requests[rid].pooling_params
            if params is not None:
                try:
                    data = self._chunk(rid, chunk.num_computed_tokens, chunk.samples,
                                       hidden[offset:offset + n], params)
                    if data is not None:
                        pooled[rid] = finish_pooled(data, params)
                except Exception as exc:  # noqa: BLE001 - isolate this request
                    logger.error("pooling request %r failed", rid, exc_info=exc)
                    self._partial.pop(rid, None)
                    failed[rid] = describe(exc)
            offset += n
        return pooled, failed

    def _chunk(self, rid: str, start: int, last: bool, rows: torch.Tensor,
               params: PoolingParams) -> torch.Tensor | None:
        kind = params.pooling_type or "LAST"
        if kind == "LAST":
            return rows[-1] if last else None
        if start == 0:
            self._partial[rid] = []  # a fresh start (or a preempted request's recompute)
        have = self._partial.get(rid)
        if have is None or sum(len(r) for r in have) != start:
            raise ValueError(f"{kind} pooling needs every prompt position computed, but request "
                             f"{rid!r} starts at position {start} (a prefix-cache hit)")
        have.append(rows)
        if not last:
            return None
        return pool_hidden_states(torch.cat(self._partial.pop(rid)), kind)

    def remove(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests' kept rows."""
        for rid in request_ids:
            self._partial.pop(rid, None)
