"""OutputProcessor: the step's new tokens -> text, stop strings, logprobs -> RequestOutputs.

It is the registry of the requests in flight: a :class:`ParentRequest` per request id the
user added, a :class:`SequenceState` per child sequence. Work on one request that raises
(detokenization, stop strings, logprob conversion, building its output) finishes that
request with finish_reason "error" and the message in ``RequestOutput.error``; the traceback
is logged once and every other request goes on. It writes no request: the stop strings and
errors it finds are the scheduler's input (``StepOutputs.reqs_to_abort``, vLLM's name), handed
to ``finish_request`` (the scheduler's ``finish_from_output``) the moment they are found, so
the scheduler -- the one writer of a request's status, tokens and finish time -- has finished a
request before its output is built.
Logprob tokens get their strings as vLLM decodes them (:mod:`workbench.engine.logprobs`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workbench.engine.detokenizer import IncrementalDetokenizer
from workbench.engine.logprobs import LogprobTokenDecoder
from workbench.outputs import Logprob, RequestOutput
from workbench.sampling_params import RequestOutputKind
from workbench.engine.parallel_sampling import ParentRequest
from workbench.utils.reprs import html_table
from workbench.request import Request, RequestStatus
from workbench.engine.request_state import SequenceState
from workbench.metrics.stats import FinishedRequestStats, IterationStats
from workbench.utils.errors import describe

if TYPE_CHECKING:
    from workbench.worker.sampler import TokenLogprobs

logger = logging.getLogger("workbench")


@dataclass
class StepOutputs:
    """``outputs`` for the caller; ``reqs_to_abort``: the requests this step's processing
    ended that the scheduler still held, in the order found, with the status they were
    finished with (FINISHED_STOPPED: a stop string; FINISHED_ERROR: their processing raised);
    ``stats``: the step's IterationStats (the ones passed in, or new)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: dict[str, RequestStatus] = field(default_factory=dict)
    stats: IterationStats = field(default_factory=IterationStats)


class _NoText:
    """The detokenizer of a request with ``detokenize=False``: no text, no stop strings."""

    text = ""
    num_output_tokens = 0  # no stop string can match, so nothing is ever cut

    def update(self, new_token_ids) -> None:
        return None

    def flush(self) -> None:
        return None

    def visible_text(self, finished: bool) -> str:
        return ""

    def get_delta(self, finished: bool) -> str:
        return ""


_NO_TEXT = _NoText()


class OutputProcessor:
    """Builds each step's RequestOutputs (see module docstring); owns no scheduling state."""

    def __init__(self, tokenizer: Any, finish_request: Callable[..., None] | None = None) -> None:
        """``finish_request(request_id, status, *, num_output_tokens, error, now)`` finishes a
        request the processing ended (the scheduler's ``finish_from_output``); None: nobody
        is told (a test playing the scheduler reads ``reqs_to_abort``)."""
        self.tokenizer = tokenizer
        self.finish_request = finish_request
        self._logprob_decoder = LogprobTokenDecoder(tokenizer)
        self.parents: dict[str, ParentRequest] = {}  # by the id given to add_request
        self._sequences: dict[str, tuple[ParentRequest, SequenceState]] = {}  # by child id
        self._aborted_stats: list[FinishedRequestStats] = []
        self._deferring: dict[str, ParentRequest] = {}  # parents with siblings held back

    # ------------------------------------------------------------------ registry
    def add_request(self, parent: ParentRequest) -> None:
        """Track a request and its children; ValueError (nothing tracked) if an id is in flight."""
        clash = [parent.request_id] if parent.request_id in self.parents else []
        clash += [c.request_id for c in parent.children if c.request_id in self._sequences]
        if clash:
            raise ValueError(f"request_id {clash[0]!r} is already in flight.")
        for i, child in enumerate(parent.children):
            wants_logprobs = child.sampling_params.logprobs is not None
            wants_prompt = getattr(child.sampling_params, "prompt_logprobs", None) is not None
            detokenize = child.sampling_params.detokenize
            state = SequenceState(
                request=child,
                index=i,
                detokenizer=IncrementalDetokenizer(self.tokenizer, child) if detokenize else _NO_TEXT,
                logprobs=[] if wants_logprobs else None,
                cumulative_logprob=0.0 if wants_logprobs else None,
                prompt_logprobs=[None] if wants_prompt else None,
                counts_only=(not detokenize and not wants_logprobs
                             and parent.params.output_kind is RequestOutputKind.FINAL_ONLY),
            )
            parent.sequences.append(state)
            self._sequences[child.request_id] = (parent, state)
        self.parents[parent.request_id] = parent
        if parent.deferred:
            self._deferring[parent.request_id] = parent

    def discard(self, request_id: str) -> None:
        """Forget a request nobody has seen (its add was rolled back)."""
        if request_id in self.parents:
            self._forget(self.parents[request_id])

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def release_siblings(self) -> list[Request]:
        """Deferred n > 1 siblings whose child 0 computed its prompt (see ParentRequest)."""
        released = [r for p in self._deferring.values() for r in p.release_siblings()]
        self._deferring = {rid: p for rid, p in self._deferring.items() if p.deferred}
        return released

    # ------------------------------------------------------------------ the step
    def process(
        self,
        requests: Iterable[Request],
        *,
        logprobs: Mapping[str, TokenLogprobs] | None = None,
        prompt_logprobs: Mapping[str, tuple[int, list[TokenLogprobs]]] | None = None,
        errors: Mapping[str, str] | None = None,
        stats: IterationStats | None = None,
        now: float | None = None,
    ) -> StepOutputs:
        """Turn a step's results into outputs.

        ``requests`` got a token this step; ``logprobs`` must cover those that asked for
        them; ``prompt_logprobs[id] = (first prompt index, entries)`` for prefill chunks of
        requests that asked; ``errors`` maps the requests the scheduler finished with an error
        this step (``Scheduler.finished_request_errors``: a failed grammar compile or runner
        row, a token the grammar refused) to the message: their new tokens, if any, are
        processed first (as in vLLM, a refused token is still in the final output), then the
        error ends their output. ``now`` is the step's output time, the one the scheduler
        stamped this step's first tokens and finishes with (default: the clock now).
        """
        now = time.monotonic() if now is None else now
        stats = IterationStats() if stats is None else stats
        stats.finished_requests.extend(self._aborted_stats)
        self._aborted_stats = []
        result = StepOutputs(stats=stats)
        touched: dict[str, ParentRequest] = {}

        def fail(state: SequenceState, error: BaseException | str, *, report: bool = True) -> None:
            """Finish ``state`` with the error (``report``: ask the scheduler to finish it);
            an exception's traceback is logged once."""
            if isinstance(error, BaseException):
                logger.error("request %r failed and was finished with an error; the others "
                             "go on", state.request.request_id, exc_info=error)
                error = describe(error)
            state.error = error
            state.finish("error", None)
            if report:
                self._report(result, state.request, RequestStatus.FINISHED_ERROR, now, error=error)

        for rid, (start, entries) in (prompt_logprobs or {}).items():
            parent, state = self._sequences[rid]
            try:  # a prefill chunk alone makes no output (no token yet)
                self._add_prompt_logprobs(state, start, entries)
            except Exception as exc:  # noqa: BLE001 - isolate this request
                fail(state, exc)
                touched[parent.request_id] = parent
        logprobs = logprobs or {}
        sequences, update, final_only = self._sequences, self._update, RequestOutputKind.FINAL_ONLY
        itls = stats.inter_token_latencies_iter
        for request in requests:
            entry = sequences.get(request.request_id)
            if entry is None:
                raise KeyError(
                    f"request_id {request.request_id!r} was never added (or already finished)."
                )
            parent, state = entry
            last = state.last_token_ts
            if (state.counts_only and last is not None and state.finish_reason is None
                    and not request.status.is_finished):
                # What _update does for it (no text, no stop string, no logprobs, not its first
                # token): count the new tokens. Nothing to give before it finishes.
                num_new = len(request.output_token_ids) - state.num_seen
                if num_new:
                    state.num_seen = state.num_processed = state.num_seen + num_new
                    itls.append(now - last)
                    state.last_token_ts = now
                    stats.num_generation_tokens += num_new
                continue
            if state.finish_reason is None:
                try:
                    if update(state, request, logprobs, stats, now) and not request.is_finished:
                        self._report(result, request, RequestStatus.FINISHED_STOPPED, now,
                                     num_output_tokens=state.num_seen)
                except Exception as exc:  # noqa: BLE001 - isolate this request
                    fail(state, exc)
                if state.finish_reason is None and parent.params.output_kind is final_only:
                    continue  # nothing to give, and no stats, before it finishes
            touched[parent.request_id] = parent
        for rid, message in (errors or {}).items():  # after their tokens, if any
            parent, state = self._sequences[rid]
            touched[parent.request_id] = parent
            if state.error is None:
                fail(state, message, report=False)
        for parent in touched.values():
            try:
                out = parent.make_output()
            except Exception as exc:  # noqa: BLE001 - isolate this request
                logger.error("building the output of request %r failed; it was finished with "
                             "an error", parent.request_id, exc_info=exc)
                for state in parent.sequences:
                    if state.finish_reason is None:
                        fail(state, describe(exc))
                parent.deferred = []
                out = parent.error_output(describe(exc))
            if out is not None:
                result.outputs.append(out)
            any_finished = False
            for state in parent.sequences:
                if state.finish_reason is not None:
                    any_finished = True
                    if not state.stats_recorded:
                        state.stats_recorded = True
                        stats.finished_requests.append(state.finished_stats())
            if any_finished and parent.finished:
                self._forget(parent)
        return result

    def child_ids(self, request_ids: Iterable[str]) -> list[str]:
        """The child sequences' ids of these requests in flight (unknown ids are ignored)."""
        return [s.request.request_id for rid in request_ids if rid in self.parents
                for s in self.parents[rid].sequences]

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Finish requests (the ids given to add_request) with finish_reason "abort", after
        the scheduler finished their children (see :meth:`child_ids`). Returns their final
        outputs. Unknown or finished ids are ignored.
        """
        outputs: list[RequestOutput] = []
        outputs: list[RequestOutput] = []
        for rid in request_ids:
            parent = self.parents.get(rid)
            if parent is None:
                continue
            parent.deferred = []
            for state in parent.sequences:
                if state.finish_reason is None:
                    state.detokenizer.flush()
                    state.finish(RequestStatus.FINISHED_ABORTED.finish_reason, None)
                    state.stats_recorded = True
                    self._aborted_stats.append(state.finished_stats())
            out = parent.make_output()
            if out is not None:
                outputs.append(out)
            self._forget(parent)
        return outputs

    def __repr__(self) -> str:
        return f"OutputProcessor(unfinished={len(self.parents)})"

    def _repr_html_(self) -> str:
        return html_table("OutputProcessor: requests in flight",
                          {rid: repr(p) for rid, p in self.parents.items()} or {"none": ""})

    # ------------------------------------------------------------------ internals
    def _report(self, result: StepOutputs, request: Request, status: RequestStatus, now: float,
                *, num_output_tokens: int | None = None, error: str | None = None) -> None:
        """Hand the scheduler a request this processing ended (vLLM's reqs_to_abort)."""
        result.reqs_to_abort[request.request_id] = status
        if self.finish_request is not None:
            self.finish_request(request.request_id, status, num_output_tokens=num_output_tokens,
                                error=error, now=now)

    def _forget(self, parent: ParentRequest) -> None:
        del self.parents[parent.request_id]
        self._deferring.pop(parent.request_id, None)
        for state in parent.sequences:
            del self._sequences[state.request.request_id]

    def _update(
        self,
        state: SequenceState,
        request: Request,
        logprobs: Mapping[str, TokenLogprobs | list[TokenLogprobs]],
        stats: IterationStats,
        now: float,
    ) -> bool:
        """Feed the request's new tokens; True when a stop string ended its text.

        A step may bring several tokens (speculative decoding); a stop string completed by
        one of them leaves the tokens after it unseen (``num_seen`` stops there, and the
        scheduler drops them from the request), as one token at a time would have."""
        output_ids, num_seen, status = request.output_token_ids, state.num_seen, request.status
        num_new, finished = len(output_ids) - num_seen, status.is_finished
        detok = state.detokenizer
        stop = None  # without text (detokenize=False) no stop string: the new ids are only counted
        if detok is not _NO_TEXT:
            new_ids = output_ids[num_seen:]
            # A stop token (eos or stop_token_ids) ended the request: as vLLM, its text is
            # left out unless include_stop_str_in_output.
            hide_last = (new_ids and status is RequestStatus.FINISHED_STOPPED
                         and not request.sampling_params.include_stop_str_in_output)
            stop = detok.update(new_ids[:-1] if hide_last else new_ids)
            if stop is not None and num_new > 1:  # the tokens after the one that stopped it
                num_new = detok.num_output_tokens - num_seen  # it was fed the tokens seen before
            if stop is None and finished:
                stop = detok.flush()
        if num_new:
            state.num_seen = num_seen = num_seen + num_new
            last = state.last_token_ts
            if last is None:
                first = request.first_token_time if request.first_token_time is not None else now
                stats.time_to_first_tokens_iter.append(first - request.arrival_time)
                stats.num_prompt_tokens += request.num_prompt_tokens
            else:
                stats.inter_token_latencies_iter.append(now - last)
            state.last_token_ts = now
            stats.num_generation_tokens += num_new
            if state.logprobs is not None:
                self._add_logprobs(state, request, logprobs, num_new)
        if stop is not None:
            state.finish("stop", stop)
        elif finished:
            state.finish(status.finish_reason, request.stop_reason)
        state.num_processed = num_seen
        if detok is not _NO_TEXT:
            state.text_processed = len(detok.text)
        return stop is not None

    def _add_logprobs(self, state: SequenceState, request: Request,
                      logprobs: Mapping[str, TokenLogprobs | list[TokenLogprobs]], num_new: int) -> None:
        """The logprobs of the request's ``num_new`` tokens seen in this step."""
        lp = logprobs.get(request.request_id)
        if lp is None:
            raise KeyError(
                f"request {request.request_id!r} asked for logprobs={request.sampling_params.logprobs} "
                "but the step brought none for it."
            )
        for entry in (lp if isinstance(lp, list) else [lp])[:num_new]:
            state.logprobs.append(self._convert_logprobs(entry, state.logprobs))
            state.cumulative_logprob += entry.logprob

    def _add_prompt_logprobs(
        self, state: SequenceState, start: int, entries: list[TokenLogprobs]
    ) -> None:
        """Append prompt positions not seen yet (a preempted request recomputes its prompt)."""
        have = state.prompt_logprobs
        if have is None:
            raise KeyError(f"request {state.request.request_id!r} did not ask for prompt_logprobs.")
        if start > len(have):
            raise ValueError(
                f"prompt logprobs of request {state.request.request_id!r} skip positions "
                f"{len(have)}..{start - 1}."
            )
        for lp in entries[len(have) - start :]:
            have.append(self._convert_logprobs(lp, have))

    def _convert_logprobs(self, lp: TokenLogprobs,
                          before: list[dict[int, Logprob] | None]) -> dict[int, Logprob]:
        """The chosen (or prompt) token first, then the top-k (``TokenLogprobs.ranked``), each
        with its string as vLLM decodes it (:mod:`workbench.engine.logprobs`): ``before``
        holds the positions already converted, whose first tokens are the context."""
        ranked = lp.ranked()
        context = [next(iter(d)) for d in before[-4:] if d]
        strings = self._logprob_decoder.position_strings([t for t, _, _ in ranked], context)
        return {token_id: Logprob(value, rank, text)
                for (token_id, value, rank), text in zip(ranked, strings)}
