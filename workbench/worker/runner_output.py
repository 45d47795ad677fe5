"""RunnerOutput: what one ``Runner.execute`` returns (its own module: a simulated runner makes
one without importing the model runner's torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workbench.core.sched.output import SpecDecodeResult

if TYPE_CHECKING:
    from workbench.worker.batch_inputs import BatchInputs
    from workbench.worker.sampler import TokenLogprobs


@dataclass(frozen=True)
class RunnerOutput:
    """What one execute() produced, by request id: sampled tokens, their logprobs, prompt
    logprobs ``(first prompt index, entries)`` of prefill chunks that asked, and the rows
    whose own work raised (``failed``: the ``describe``d error; such a row has no token,
    logprobs or prompt logprobs, and the scheduler finishes it with an error); plus the
    batch (None when nothing was scheduled) and timings (s).

    A speculating request's ``sampled_token_ids`` entry is the target's own token, emitted
    after its accepted drafts; ``spec_decode`` holds its drafts and how many were accepted,
    and its ``logprobs`` entry is a list, one per emitted token (accepted drafts, then that)."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs | list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    batch: BatchInputs | None = None
    timings: dict[str, float] = field(default_factory=dict)
    spec_decode: dict[str, SpecDecodeResult] = field(default_factory=dict)
    #: The pooled data of each pooling request whose prompt this step completed (it samples
    #: nothing): see :mod:`workbench.model.pooler`.
    pooler_output: dict = field(default_factory=dict)
    kv_connector_output: object = None  # the KV connector's finished transfers (vLLM's)
