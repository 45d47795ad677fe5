"""SchedulerOutput: the per-step batch that Scheduler.schedule() decides and the runner executes."""

from __future__ import annotations

import html
from dataclasses import dataclass, field

import msgspec

from workbench.core.kv_cache_manager import KVCacheStats


class ScheduledRequest(msgspec.Struct, frozen=True, gc=False):
    """One request's share of a step: a read-only record, equal and hashable by value. A
    ``msgspec.Struct`` (built in C, not tracked by the cycle collector: it holds only
    strings, ints and tuples of ints) rather than a dataclass: one is built per scheduled
    request per step, and a slotted dataclass costs about three times as much to build (a
    frozen one more).

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
    lora_name: str | None = None  # the request's LoRA adapter (None: the base model)
    #: Draft tokens to verify: the last ``len(spec_token_ids)`` of ``token_ids`` (a speculating
    #: decode: the last known token, then the drafts; it samples 1 + accepted tokens).
    spec_token_ids: tuple[int, ...] = ()

    @property
    def seq_len(self) -> int:
        """Tokens in the KV cache after this step, the new ones included."""
        return self.num_computed_tokens + self.num_new_tokens


@dataclass(frozen=True, slots=True)
class SpecDecodeResult:
    """One speculating request's verification in one step: the drafts it scheduled and how
    many the target accepted (a prefix of them). The request emits ``draft_token_ids[:
    num_accepted]`` and then the target's own token: the *bonus* token when every draft was
    accepted, else the token the rejection sampler drew in place of the first rejected draft
    (a stop condition inside the run -- eos, a stop string, max_tokens -- cuts it short there)."""

    draft_token_ids: tuple[int, ...]
    num_accepted: int

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def num_rejected(self) -> int:
        return len(self.draft_token_ids) - self.num_accepted

    @property
    def accepted_token_ids(self) -> tuple[int, ...]:
        return self.draft_token_ids[: self.num_accepted]

    @property
    def bonus(self) -> bool:
        """Whether every draft was accepted (the target's token is a bonus)."""
        return self.num_accepted == len(self.draft_token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything one step decided. Immutable: kept on the step's record for inspection.

    ``kv_cache_stats``: the KV cache's counts since they were last taken (by the previous
    ``schedule()``, or by the engine recording the previous step); only ``schedule()``
    allocates, evicts and queries the prefix cache, so those counts are this schedule's.
    """

    step: int
    scheduled: tuple[ScheduledRequest, ...]
    new_request_ids: tuple[str, ...] = ()
    resumed_request_ids: tuple[str, ...] = ()
    preempted_request_ids: tuple[str, ...] = ()
    finished_request_ids: tuple[str, ...] = ()  # finished or aborted since the previous step
    token_budget: int = 0
    kv_cache_stats: KVCacheStats = field(default_factory=KVCacheStats)
    num_free_blocks: int = 0  # after scheduling
    kv_usage: float = 0.0  # after scheduling, in [0, 1]
    #: Waiting requests passed over because their adapter would exceed ``max_loras``.
    lora_skipped_request_ids: tuple[str, ...] = ()
    #: Why (``workbench.core.sched.explain.StepExplanation``): the reason of every request
    #: not fully scheduled, the preemptions and the prefix lookups; None when not recorded.
    explanation: object | None = None
    #: The KV connector's work for the worker side this step (vLLM's), else None.
    kv_connector_metadata: object = None

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The distinct adapters in this batch, in batch order."""
        return tuple(dict.fromkeys(s.lora_name for s in self.scheduled if s.lora_name))

    @property
    def num_blocks_allocated(self) -> int:
        return self.kv_cache_stats.num_blocks_allocated

    @property
    def num_blocks_evicted(self) -> int:
        """Cached blocks whose hash was dropped to serve this step."""
        return self.kv_cache_stats.num_blocks_evicted

    @property
    def num_prefix_cache_hit_tokens(self) -> int:
        return self.kv_cache_stats.prefix_cache_hits

    @property
    def scheduled_spec_decode_tokens(self) -> dict[str, tuple[int, ...]]:
        """vLLM's name: request id -> the draft tokens scheduled for verification this step."""
        return {s.request_id: s.spec_token_ids for s in self.scheduled if s.spec_token_ids}

    @property
    def num_spec_tokens(self) -> int:
        """Draft tokens among the scheduled tokens (they count in the token budget)."""
        return sum(len(s.spec_token_ids) for s in self.scheduled)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def _id_groups(self) -> list[tuple[str, tuple[str, ...]]]:
        """The non-empty (label, request ids) groups: new, resumed, preempted, finished."""
        groups = (
            ("new", self.new_request_ids),
            ("resumed", self.resumed_request_ids),
            ("preempted", self.preempted_request_ids),
            ("finished", self.finished_request_ids),
            ("skipped_max_loras", self.lora_skipped_request_ids),
        )
        return [(name, ids) for name, ids in groups if ids]

    def _chunk_line(self, s: ScheduledRequest) -> str:
        kind = "prefill" if s.is_prefill else "decode"
        hit = f" cached={s.num_cached_tokens}" if s.num_cached_tokens else ""
        hit += f" lora={s.lora_name}" if s.lora_name else ""
        sample = " -> sample" if s.samples else ""
        if s.spec_token_ids:
            sample += f" spec={list(s.spec_token_ids)}"
        return (
            f"{s.request_id}: {kind} [{s.num_computed_tokens}, {s.seq_len}){hit} "
            f"blocks={list(s.block_ids)}{sample}"
        )

    def __repr__(self) -> str:
        """Deterministic: one header line, then one line per scheduled chunk."""
        ids = [f"{name}={list(v)}" for name, v in self._id_groups()]
        head = (
            f"SchedulerOutput(step={self.step}, tokens={self.total_num_scheduled_tokens}/{self.token_budget}"
            + "".join(f", {x}" for x in ids)
            + f", blocks_allocated={self.num_blocks_allocated}, blocks_evicted={self.num_blocks_evicted}"
            f", prefix_hit_tokens={self.num_prefix_cache_hit_tokens}, free_blocks={self.num_free_blocks}"
            f", kv_usage={self.kv_usage:.3f}"
        )
        if not self.scheduled:
            return head + ", scheduled=[])"
        return head + ",\n" + ",\n".join("  " + self._chunk_line(s) for s in self.scheduled) + ")"

    def _repr_html_(self) -> str:
        """A summary line and one table row per scheduled chunk."""
        rows = "".join(
            "<tr>"
            + "".join(
                f"<td>{html.escape(str(c))}</td>"
                for c in (
                    s.request_id,
                    "prefill" if s.is_prefill else "decode",
                    f"[{s.num_computed_tokens}, {s.seq_len})",
                    s.num_new_tokens,
                    s.num_cached_tokens,
                    " ".join(map(str, s.block_ids)),
                    "yes" if s.samples else "",
                )
            )
            + "</tr>"
            for s in self.scheduled
        )
        head = "".join(
            f"<th>{h}</th>" for h in ("request", "kind", "tokens", "new", "cached", "blocks", "samples")
        )
        notes = "".join(f", {name}: {html.escape(' '.join(v))}" for name, v in self._id_groups())
        return (
            f"<div><b>Step {self.step}</b>: {self.total_num_scheduled_tokens}/{self.token_budget} tokens, "
            f"{len(self.scheduled)} requests{notes}; {self.num_blocks_allocated} blocks allocated, "
            f"{self.num_blocks_evicted} evicted, {self.num_prefix_cache_hit_tokens} prefix-hit tokens, "
            f"{self.num_free_blocks} free, usage {self.kv_usage:.1%}"
            f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>"
        )
