"""What a user gets back: RequestOutput / CompletionOutput (vLLM's names), and the
OutputProcessor that builds them from the requests that got tokens in a step."""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from workbench.detokenizer import IncrementalDetokenizer
from workbench.request import Request, RequestStatus

if TYPE_CHECKING:
    from workbench.sampling import TokenLogprobs


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


@dataclass
class RequestOutput:
    """A request's result (``finished``) or, when streaming, its latest delta."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0

    def __repr__(self) -> str:
        outs = ", ".join(
            f"CompletionOutput(index={o.index}, text={o.text!r}, finish_reason={o.finish_reason!r})"
            for o in self.outputs
        )
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"outputs=[{outs}], finished={self.finished})"
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
            f"{'finished' if self.finished else 'running'}</caption>"
            "<tr><th>index</th><th>text</th><th>tokens</th><th>finish_reason</th>"
            f"<th>stop_reason</th></tr>{rows}</table>"
        )


# ---------------------------------------------------------------------------- processor
@dataclass(eq=False)
class _Child:
    """One sequence's output state (a request added with add_request)."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    num_seen: int = 0  # output tokens already fed to the detokenizer
    num_tokens_sent: int = 0  # output tokens / logprob positions already streamed
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finished_time: float | None = None
    final_sent: bool = False  # streaming: the output carrying finish_reason went out


@dataclass(eq=False)
class _Parent:
    """The user's request: n children reported as one RequestOutput."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    children: dict[int, _Child] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return len(self.children) == self.n and all(
            c.finish_reason is not None for c in self.children.values()
        )


class OutputProcessor:
    """Turns the requests that got new tokens in a step into RequestOutputs.

    Two output kinds, as vLLM's ``RequestOutputKind``:

    * ``stream=False`` (FINAL_ONLY): a RequestOutput only once the request (all n
      children) finished, with the full text, tokens and logprobs of every child;
    * ``stream=True`` (DELTA): a RequestOutput for every step a request got tokens, whose
      CompletionOutputs (only the children updated in that step) carry the new text,
      token ids and logprobs since the previous output; ``cumulative_logprob`` is the
      running total. Concatenating the deltas gives the FINAL_ONLY text and tokens.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._children: dict[str, tuple[_Parent, _Child]] = {}
        self._parents: dict[str, _Parent] = {}

    def add_request(
        self,
        request: Request,
        prompt: str | None,
        parent_id: str | None = None,
        index: int = 0,
        n: int = 1,
    ) -> None:
        """Track a request. For ``SamplingParams.n > 1`` add each child with the shared
        ``parent_id`` (the id its RequestOutput carries), its ``index`` and ``n``."""
        if request.request_id in self._children:
            raise ValueError(f"request_id {request.request_id!r} is already tracked.")
        if not 0 <= index < n:
            raise ValueError(f"index must be in [0, n={n}), got {index}.")
        parent_id = request.request_id if parent_id is None else parent_id
        parent = self._parents.get(parent_id)
        if parent is not None and parent.n != n:
            raise ValueError(f"n must be {parent.n} for every child of {parent_id!r}, got {n}.")
        if parent is not None and index in parent.children:
            raise ValueError(f"index {index} of {parent_id!r} was already added.")
        if parent is None:
            parent = _Parent(parent_id, prompt, list(request.prompt_token_ids), n)
            self._parents[parent_id] = parent
        wants_logprobs = request.sampling_params.logprobs is not None
        child = _Child(
            request=request,
            index=index,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request),
            logprobs=[] if wants_logprobs else None,
            cumulative_logprob=0.0 if wants_logprobs else None,
        )
        parent.children[index] = child
        self._children[request.request_id] = (parent, child)

    def process(
        self,
        requests: list[Request],
        logprobs: dict[str, TokenLogprobs] | None = None,
        stream: bool = False,
    ) -> tuple[list[RequestOutput], list[str]]:
        """Detokenize the step's new tokens and build outputs.

        Returns ``(outputs, stop_ids)``: ``stop_ids`` are the requests a stop string ended
        that the scheduler has not finished yet (the caller finishes them as
        FINISHED_STOPPED). ``logprobs`` maps request ids to this step's TokenLogprobs; it
        must cover every request that asked for logprobs.
        """
        stop_ids: list[str] = []
        touched: dict[str, _Parent] = {}
        for request in requests:
            entry = self._children.get(request.request_id)
            if entry is None:
                raise KeyError(
                    f"request_id {request.request_id!r} was never added (or already finished)."
                )
            parent, child = entry
            if child.finish_reason is not None:
                continue
            if self._update(child, request, logprobs) and not request.is_finished:
                stop_ids.append(request.request_id)
            touched[parent.request_id] = parent
        outputs = [o for p in touched.values() if (o := self._make_output(p, stream)) is not None]
        return outputs, stop_ids

    def abort(self, request_ids: Iterable[str], stream: bool = False) -> list[RequestOutput]:
        """Finish requests (child or parent ids) with finish_reason "abort".

        Returns the outputs this completes (a parent is final once every child is);
        unknown or already finished ids are ignored.
        """
        touched: dict[str, _Parent] = {}
        for rid in request_ids:
            if rid in self._children:
                parent, child = self._children[rid]
                children = [child]
            elif rid in self._parents:
                parent = self._parents[rid]
                children = list(parent.children.values())
            else:
                continue
            for child in children:
                if child.finish_reason is None:
                    child.detokenizer.flush()
                    child.finish_reason = RequestStatus.FINISHED_ABORTED.finish_reason
                    child.finished_time = time.monotonic()
            touched[parent.request_id] = parent
        return [out for p in touched.values() if (out := self._make_output(p, stream)) is not None]

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def __repr__(self) -> str:
        return f"OutputProcessor(unfinished={len(self._parents)})"

    # ------------------------------------------------------------------ internals
    def _update(
        self, child: _Child, request: Request, logprobs: dict[str, TokenLogprobs] | None
    ) -> bool:
        """Feed the request's new tokens; True when a stop string ended its text."""
        new_ids = request.output_token_ids[child.num_seen :]
        child.num_seen = len(request.output_token_ids)
        detok = child.detokenizer
        params = request.sampling_params
        # A stop token (eos or stop_token_ids) ended the request: as vLLM, its text is
        # left out unless include_stop_str_in_output.
        stopped_by_token = request.status is RequestStatus.FINISHED_STOPPED
        hide_last = stopped_by_token and new_ids and not params.include_stop_str_in_output
        text_ids = new_ids[:-1] if hide_last else new_ids
        stop = detok.update(text_ids)
        if stop is None and request.is_finished:
            stop = detok.flush()
        if child.logprobs is not None and new_ids:
            lp = (logprobs or {}).get(request.request_id)
            if lp is None:
                raise KeyError(
                    f"request {request.request_id!r} asked for logprobs={params.logprobs} "
                    "but the step brought none for it."
                )
            child.logprobs.append(self._convert_logprobs(lp))
            child.cumulative_logprob += lp.logprob
        if stop is not None:
            child.finish_reason, child.stop_reason = "stop", stop
        elif request.is_finished:
            child.finish_reason = request.status.finish_reason
            child.stop_reason = request.stop_reason
        if child.finish_reason is not None:
            child.finished_time = (
                time.monotonic() if request.finished_time is None else request.finished_time
            )
        return stop is not None

    def _convert_logprobs(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        """The sampled token first, then the top-k (rank = position, 1-based)."""
        tok = getattr(self.tokenizer, "backend_tokenizer", self.tokenizer)

        def decoded(token_id: int) -> str:
            return tok.decode([token_id], skip_special_tokens=False)

        out = {lp.token_id: Logprob(lp.logprob, lp.rank, decoded(lp.token_id))}
        for rank, (token_id, value) in enumerate(lp.top, start=1):
            out.setdefault(token_id, Logprob(value, rank, decoded(token_id)))
        return out

    def _make_output(self, parent: _Parent, stream: bool) -> RequestOutput | None:
        finished = parent.finished
        if not stream and not finished:
            return None
        completions = []
        for index in sorted(parent.children):
            child = parent.children[index]
            done = child.finish_reason is not None
            if stream:
                n_ids = len(child.request.output_token_ids)
                if child.num_tokens_sent == n_ids and (child.final_sent or not done):
                    continue  # nothing new for this child in this step
                child.final_sent = done
                text = child.detokenizer.get_delta(done)
                token_ids = child.request.output_token_ids[child.num_tokens_sent :]
                logprobs = (
                    None if child.logprobs is None else child.logprobs[child.num_tokens_sent :]
                )
                child.num_tokens_sent = n_ids
            else:
                text = child.detokenizer.text
                token_ids = list(child.request.output_token_ids)
                logprobs = None if child.logprobs is None else list(child.logprobs)
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=child.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                )
            )
        if stream and not completions:
            return None
        metrics = self._metrics(parent)
        if finished:
            del self._parents[parent.request_id]
            for child in parent.children.values():
                del self._children[child.request.request_id]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=metrics,
            num_cached_tokens=metrics.num_cached_tokens,
        )

    @staticmethod
    def _metrics(parent: _Parent) -> RequestMetrics:
        """Children aggregated: earliest arrival/schedule/first token, the last finish
        (once all finished), preemptions summed, the largest prefix-cache hit."""
        reqs = [c.request for c in parent.children.values()]

        def earliest(values: Iterable[float | None]) -> float | None:
            known = [v for v in values if v is not None]
            return min(known) if known else None

        return RequestMetrics(
            arrival_time=earliest(r.arrival_time for r in reqs),
            first_scheduled_time=earliest(r.first_scheduled_time for r in reqs),
            first_token_time=earliest(r.first_token_time for r in reqs),
            finished_time=(
                max(c.finished_time for c in parent.children.values()) if parent.finished else None
            ),
            num_preemptions=sum(r.num_preemptions for r in reqs),
            num_cached_tokens=max((r.num_cached_tokens for r in reqs), default=0),
        )
