"""SchedulerOutput: the per-step batch that Scheduler.schedule() decides and the runner executes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    The runner computes tokens ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``
    of the request (``token_ids`` holds exactly those), writing their K/V into the slots that
    ``block_ids`` (the request's whole block table after allocation) maps them to.
    ``samples`` is True when this chunk reaches the end of the known tokens, so the step
    yields one new token for the request.
    """

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    is_prefill: bool
    samples: bool
    num_cached_tokens: int = 0  # prefix-cache hit tokens found when this request was (re)scheduled

    @property
    def seq_len(self) -> int:
        """Tokens in the KV cache after this step, the new ones included."""
        return self.num_computed_tokens + self.num_new_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything one step decided. Immutable: kept on the step's record for inspection."""

    step: int
    scheduled: tuple[ScheduledRequest, ...]
    new_request_ids: tuple[str, ...] = ()
    resumed_request_ids: tuple[str, ...] = ()
    preempted_request_ids: tuple[str, ...] = ()
    finished_request_ids: tuple[str, ...] = ()  # finished or aborted since the previous step
    token_budget: int = 0
    num_blocks_allocated: int = 0
    num_blocks_evicted: int = 0  # cached blocks whose hash was dropped to serve this step
    num_prefix_cache_hit_tokens: int = 0
    num_free_blocks: int = 0  # after scheduling
    kv_usage: float = 0.0  # after scheduling, in [0, 1]
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
