"""Engine statistics as vLLM's stat loggers see them.

Each ``LLMEngine.step()`` builds one :class:`SchedulerStats` (the queues and the KV cache
after the step, and this step's prefix-cache and preemption counts) and one
:class:`IterationStats` (tokens of the step, first-token and inter-token latencies of the
requests that got tokens, and a :class:`FinishedRequestStats` per request that finished),
and hands both to every registered :class:`StatLoggerBase` (``record``).
``LLMEngine.do_log_stats()`` calls each logger's ``log``. Two loggers ship: the periodic
log line (:class:`LoggingStatLogger`) and the Prometheus exporter
(``workbench.metrics.prometheus.PrometheusStatLogger``). A notebook subclasses StatLoggerBase for its own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

from workbench.utils.reprs import html_table

logger = logging.getLogger("workbench")


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler and KV cache after one step, built once per step (its StepRecord holds
    it); counts marked "this step" are increments since the previous step's stats (blocks
    freed by aborts between two steps count in the later one)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # in [0, 1]
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0  # requests preempted this step
    num_blocks_allocated: int = 0  # this step
    num_blocks_freed: int = 0  # this step: blocks whose ref_count fell to 0
    num_blocks_evicted: int = 0  # this step: cached blocks whose hash was dropped to serve it
    #: LoRA adapter name -> requests running / waiting under it (LoRA enabled only).
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    spec_decoding_stats: SpecDecodingStats | None = None  # this step; None without drafts
    #: vLLM's ``num_requests_waiting_by_reason``: "capacity" and "deferred" (a grammar
    #: compiling, remote KV), summing to ``num_waiting_reqs``.
    num_waiting_reqs_by_reason: dict[str, int] = field(default_factory=dict)
    #: This step's preemptions by reason ("made_room": for another request, "own_victim":
    #: the request short of blocks was the victim).
    num_preemptions_by_reason: dict[str, int] = field(default_factory=dict)
    kv_connector_stats: KVConnectorStats | None = None  # this step's KV loads; None without any

    def _repr_html_(self) -> str:
        return html_table("SchedulerStats", asdict(self))


@dataclass(frozen=True)
class KVConnectorStats:
    """vLLM's: the KV loads this engine started in one step (a consumer's), one entry each:
    ``transfer_duration`` (modelled seconds on the link), ``bytes_transferred`` and
    ``num_descriptors`` (blocks). Exported as vLLM's NIXL histograms."""

    transfer_duration: tuple[float, ...] = ()
    bytes_transferred: tuple[int, ...] = ()
    num_descriptors: tuple[int, ...] = ()

    @classmethod
    def of(cls, transfers) -> KVConnectorStats | None:
        transfers = tuple(transfers)
        if not transfers:
            return None
        return cls(tuple(t.seconds for t in transfers), tuple(t.num_bytes for t in transfers),
                   tuple(t.num_blocks for t in transfers))


@dataclass(frozen=True)
class SpecDecodingStats:
    """Speculative decoding in one step (vLLM's): ``num_drafts`` requests verified drafts,
    ``num_draft_tokens`` of them in all, ``num_accepted_tokens`` accepted;
    ``num_accepted_tokens_per_pos[j]``: drafts accepted at position ``j`` (0-based)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @classmethod
    def of(cls, results) -> SpecDecodingStats | None:
        """From a step's ``SpecDecodeResult`` values (None when there are none)."""
        results = list(results)
        if not results:
            return None
        per_pos = [0] * max(r.num_draft_tokens for r in results)
        for r in results:
            for j in range(r.num_accepted):
                per_pos[j] += 1
        return cls(len(results), sum(r.num_draft_tokens for r in results),
                   sum(r.num_accepted for r in results), tuple(per_pos))


@dataclass(frozen=True)
class FinishedRequestStats:
    """One finished request (one sequence of an n > 1 request): its latencies in seconds."""

    finish_reason: str
    e2e_latency: float  # arrival -> finished
    # Each phase below is None when the request never reached its end (vLLM records none):
    # never scheduled (an abort while queued), no token (an abort or error before the first).
    time_to_first_token: float | None  # arrival -> first token
    queued_time: float | None  # arrival -> first scheduled
    prefill_time: float | None  # first scheduled -> first token
    decode_time: float | None  # first token -> last token
    inference_time: float | None  # first scheduled -> last token
    num_prompt_tokens: int
    num_generation_tokens: int
    mean_time_per_output_token: float | None  # decode_time / (tokens - 1); 0 for one token

    def __repr__(self) -> str:  # times vary from run to run: counts only
        return (
            f"FinishedRequestStats(finish_reason={self.finish_reason!r}, "
            f"num_prompt_tokens={self.num_prompt_tokens}, "
            f"num_generation_tokens={self.num_generation_tokens})"
        )

    def _repr_html_(self) -> str:
        return html_table("FinishedRequestStats", {
            k: f"{v:.4f} s" if isinstance(v, float) else v for k, v in asdict(self).items()})


@dataclass
class IterationStats:
    """What one step did: tokens, per-token latencies, finished requests, and grammars:
    the seconds of each grammar compile that ended, the requests whose grammar was cached."""

    num_prompt_tokens: int = 0  # prompt (and recomputed) tokens computed this step
    num_generation_tokens: int = 0  # tokens sampled this step
    time_to_first_tokens_iter: list[float] = field(default_factory=list)  # arrival -> first token
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    grammar_compile_seconds: list[float] = field(default_factory=list)
    num_grammar_cache_hits: int = 0
    #: (reason, seconds) of each request whose deferral ended this step ("grammar": it left
    #: WAITING_FOR_FSM; "remote_kv" reserved): vLLM's ``request_deferred_time_seconds``.
    deferred_times: list[tuple[str, float]] = field(default_factory=list)

    def __repr__(self) -> str:  # latencies vary from run to run: counts only
        return (
            f"IterationStats(num_prompt_tokens={self.num_prompt_tokens}, "
            f"num_generation_tokens={self.num_generation_tokens}, "
            f"first_tokens={len(self.time_to_first_tokens_iter)}, "
            f"finished={[f.finish_reason for f in self.finished_requests]})"
        )

    def _repr_html_(self) -> str:
        def ms(values: list[float]) -> str:
            return ", ".join(f"{v * 1e3:.1f} ms" for v in values) or "-"

        return html_table("IterationStats", {
            "prompt tokens": self.num_prompt_tokens,
            "generation tokens": self.num_generation_tokens,
            "time to first token": ms(self.time_to_first_tokens_iter),
            "inter-token latency": ms(self.inter_token_latencies_iter),
            "finished": ", ".join(f.finish_reason for f in self.finished_requests) or "-",
        })


class StatLoggerBase:
    """A consumer of engine statistics (vLLM's interface).

    ``record`` is called once per step with that step's stats; ``log`` when the engine's
    ``do_log_stats()`` runs (periodically with ``EngineConfig.log_stats``, or by hand).
    """

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        raise NotImplementedError

    def log(self) -> None:
        """Emit what was recorded since the last call (default: nothing)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def _repr_html_(self) -> str:
        return html_table(type(self).__name__, {"kind": "stat logger"})


class LoggingStatLogger(StatLoggerBase):
    """vLLM's periodic line: throughputs since the last line, queues, KV usage, prefix hit rate.

    ``last_line`` keeps the most recent line (also sent to the "workbench" logger at INFO).
    With speculative decoding a second line follows, vLLM's "SpecDecoding metrics" since the
    last one (mean acceptance length, accepted and drafted tokens, per-position acceptance),
    kept in ``last_spec_line``.
    """

    def __init__(self) -> None:
        self.last_line: str | None = None
        self.last_spec_line: str | None = None
        self._scheduler_stats = SchedulerStats()
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self._since = now
        self._prompt_tokens = self._generation_tokens = 0
        self._queries = self._hits = 0
        self._drafts = self._draft_tokens = self._accepted = 0
        self._accepted_per_pos: list[int] = []

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self._scheduler_stats = scheduler_stats
        self._prompt_tokens += iteration_stats.num_prompt_tokens
        self._generation_tokens += iteration_stats.num_generation_tokens
        self._queries += scheduler_stats.prefix_cache_queries
        self._hits += scheduler_stats.prefix_cache_hits
        spec = scheduler_stats.spec_decoding_stats
        if spec is not None:
            self._drafts += spec.num_drafts
            self._draft_tokens += spec.num_draft_tokens
            self._accepted += spec.num_accepted_tokens
            per_pos = self._accepted_per_pos
            per_pos.extend([0] * (len(spec.num_accepted_tokens_per_pos) - len(per_pos)))
            for j, n in enumerate(spec.num_accepted_tokens_per_pos):
                per_pos[j] += n

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self._since, 1e-9)
        s = self._scheduler_stats
        hit_rate = self._hits / self._queries if self._queries else 0.0
        self.last_line = (
            f"Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {s.num_running_reqs} reqs, Waiting: {s.num_waiting_reqs} reqs, "
            f"KV cache usage: {s.kv_cache_usage:.1%}, Prefix cache hit rate: {hit_rate:.1%}"
        )
        logger.info(self.last_line)
        if self._drafts:
            rates = ", ".join(f"{n / self._drafts:.3f}" for n in self._accepted_per_pos)
            self.last_spec_line = (
                f"SpecDecoding metrics: Mean acceptance length: {1 + self._accepted / self._drafts:.2f}, "
                f"Accepted throughput: {self._accepted / elapsed:.2f} tokens/s, "
                f"Drafted throughput: {self._draft_tokens / elapsed:.2f} tokens/s, "
                f"Accepted: {self._accepted} tokens, Drafted: {self._draft_tokens} tokens, "
                f"Per-position acceptance rate: {rates}, "
                f"Avg Draft acceptance rate: {self._accepted / self._draft_tokens:.1%}"
            )
            logger.info(self.last_spec_line)
        self._reset(now)

    def _repr_html_(self) -> str:
        return html_table("LoggingStatLogger", {"last line": self.last_line or "(none yet)"})
