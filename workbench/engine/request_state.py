"""SequenceState: one child sequence's output state (detokenizer, logprobs, what was sent,
its finish and timings), kept by the OutputProcessor and read by its ParentRequest."""

from __future__ import annotations

from dataclasses import dataclass

from workbench.engine.detokenizer import IncrementalDetokenizer
from workbench.outputs import CompletionOutput, Logprob
from workbench.request import Request
from workbench.metrics.stats import FinishedRequestStats


@dataclass(eq=False)
class SequenceState:
    """One child sequence's output state: its detokenizer, logprobs and what was sent."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    prompt_logprobs: list[dict[int, Logprob] | None] | None  # [None, ...] as chunks arrive
    num_seen: int = 0  # output tokens already fed to the detokenizer
    num_tokens_sent: int = 0  # output tokens / logprob positions already in a DELTA output
    final_sent: bool = False  # DELTA: the output carrying finish_reason went out
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    last_token_ts: float | None = None  # the output time of the step that brought the last token
    stats_recorded: bool = False  # its FinishedRequestStats went into an IterationStats
    num_processed: int = 0  # output tokens whose text and logprobs were built without error
    text_processed: int = 0  # characters of the text at that point
    #: FINAL_ONLY, no text (``detokenize=False``), no logprobs: until it finishes, a step's
    #: tokens are only counted (its stats); it has no stop string and gives no output.
    counts_only: bool = False

    def __repr__(self) -> str:
        return (
            f"SequenceState({self.request.request_id!r}, index={self.index}, "
            f"tokens={self.num_seen}, sent={self.num_tokens_sent}, "
            f"finish_reason={self.finish_reason!r}, error={self.error!r})"
        )

    def completion(self, delta: bool) -> CompletionOutput | None:
        """The sequence so far, or (``delta``) what is new since the last delta; None when a
        delta has nothing new."""
        done = self.finish_reason is not None
        failed = self.error is not None
        # A stop's later tokens are unseen; after a failure, only what was processed before it.
        n_ids = min(self.num_seen, self.num_processed) if failed else self.num_seen
        if delta:
            if self.num_tokens_sent == n_ids and (self.final_sent or not done):
                return None
            start, self.num_tokens_sent, self.final_sent = self.num_tokens_sent, n_ids, done
            text = self.detokenizer.get_delta(done)
            if failed:  # the delta ends the text; keep its part from before the failure
                text = text[: max(0, self.text_processed - len(self.detokenizer.text) + len(text))]
        else:
            start = 0
            text = self.detokenizer.visible_text(done)
            if failed:
                text = text[: self.text_processed]
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.request.output_token_ids[start:n_ids],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else self.logprobs[start:n_ids],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def finish(self, reason: str, stop_reason: int | str | None) -> None:
        """The output's finish (the scheduler, told, writes the request's own status and time)."""
        self.finish_reason, self.stop_reason = reason, stop_reason

    @property
    def finished_time(self) -> float | None:
        """The time the scheduler finished the request; a deferred n > 1 sibling that never
        reached the scheduler has none of its own and ends with its last token (or arrival)."""
        r = self.request
        if r.finished_time is not None or self.finish_reason is None:
            return r.finished_time
        return self.last_token_ts if self.last_token_ts is not None else r.arrival_time

    def finished_stats(self) -> FinishedRequestStats:
        """Latencies from the times the scheduler stamped on the request (those of its request
        events), so /metrics, RequestOutput.metrics and the requests table agree. A phase the
        request never reached has no time (None), as in vLLM: an aborted request still queued
        has no queued_time, one without a token no time to first token, prefill or decode."""
        r = self.request
        end = self.finished_time
        scheduled, first, last = r.first_scheduled_time, r.first_token_time, self.last_token_ts
        if first is not None and last is None:
            last = first
        n_gen = r.num_output_tokens

        def span(start: float | None, stop: float | None) -> float | None:
            return None if start is None or stop is None else stop - start

        decode = span(first, last)
        return FinishedRequestStats(
            finish_reason=self.finish_reason or "abort",
            e2e_latency=end - r.arrival_time,
            time_to_first_token=span(r.arrival_time, first),
            queued_time=span(r.arrival_time, scheduled),
            prefill_time=span(scheduled, first),
            decode_time=decode,
            inference_time=span(scheduled, last),
            num_prompt_tokens=r.num_prompt_tokens,
            num_generation_tokens=n_gen,
            mean_time_per_output_token=(
                None if decode is None else decode / (n_gen - 1) if n_gen > 1 else 0.0),
        )
