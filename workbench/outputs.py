"""What a user gets back: RequestOutput / CompletionOutput / Logprob (vLLM's names).

Built by :class:`workbench.engine.output_processor.OutputProcessor`."""

from __future__ import annotations

import html
from dataclasses import dataclass


@dataclass
class Logprob:
    """One candidate token's log-probability; ``rank`` 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence (one of the request's ``n``).

    ``token_ids`` holds every token generated (a stop string cuts ``text``, not the
    tokens); ``logprobs`` has one dict per token when the request asked for logprobs.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        logprobs = None if self.logprobs is None else f"<{len(self.logprobs)} positions>"
        cum = None if self.cumulative_logprob is None else round(self.cumulative_logprob, 4)
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={self.token_ids}, cumulative_logprob={cum}, logprobs={logprobs}, "
            f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r})"
        )


@dataclass
class RequestMetrics:
    """A request's timeline (``time.monotonic()`` seconds) and counters.

    The plain repr shows only the counters: times differ from run to run.
    """

    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first output token; None until both are known."""
        if self.arrival_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to first being scheduled; None until both are known."""
        if self.arrival_time is None or self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        """Seconds from arrival to finishing; None while unfinished."""
        if self.arrival_time is None or self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    def __repr__(self) -> str:
        return (
            f"RequestMetrics(num_preemptions={self.num_preemptions}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )


#: vLLM's prompt logprobs: None for the first prompt token (nothing predicts it), then one
#: {token id: Logprob} per prompt token (the prompt token first, then the top-k).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestOutput:
    """A request's state after a step, per its ``SamplingParams.output_kind``: the text so far
    (CUMULATIVE), what is new since the last output (DELTA), or the result (FINAL_ONLY).

    ``error`` is set (and every sequence's finish_reason is "error") when processing this
    request raised inside a step; the engine went on with the others.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None
    #: vLLM's: what the KV connector returned when the request finished (a producer's
    #: ``do_remote_prefill`` params for the decode engine), else None.
    kv_transfer_params: dict | None = None

    def __repr__(self) -> str:
        outs = ", ".join(
            f"CompletionOutput(index={o.index}, text={o.text!r}, finish_reason={o.finish_reason!r})"
            for o in self.outputs
        )
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"outputs=[{outs}], finished={self.finished}"
            + ("" if self.error is None else f", error={self.error!r}")
            + ")"
        )

    def _repr_html_(self) -> str:
        esc = html.escape
        rows = "".join(
            f"<tr><td>{o.index}</td><td style='text-align:left;white-space:pre-wrap'>"
            f"{esc(o.text)}</td><td>{len(o.token_ids)}</td><td>{esc(str(o.finish_reason))}</td>"
            f"<td>{esc(repr(o.stop_reason))}</td></tr>"
            for o in self.outputs
        )
        return (
            f"<table><caption style='text-align:left'>RequestOutput <b>{esc(self.request_id)}</b>"
            f" &middot; prompt: <code>{esc(repr(self.prompt))}</code> "
            f"({len(self.prompt_token_ids)} tokens, {self.num_cached_tokens} cached) &middot; "
            f"{'finished' if self.finished else 'running'}"
            + ("" if self.error is None else f" &middot; error: {esc(self.error)}")
            + "</caption>"
            "<tr><th>index</th><th>text</th><th>tokens</th><th>finish_reason</th>"
            f"<th>stop_reason</th></tr>{rows}</table>"
        )
