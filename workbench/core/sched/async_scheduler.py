"""AsyncScheduler: vLLM's scheduler for async scheduling, one step ahead of the tokens.

With ``async_scheduling`` the engine schedules step N+1 while step N executes (a batch queue of
two, ``LLMEngine.step_with_batch_queue``), so step N's sampled tokens are not known when step
N+1 is decided. As vLLM's ``AsyncScheduler``:

* ``num_computed_tokens`` advances when a chunk is *scheduled* (optimistically), and a chunk
  that samples adds one to the request's ``num_output_placeholders``: a token in flight. The
  next ``schedule()`` sees ``num_tokens + num_output_placeholders`` tokens, so a decoding
  request is scheduled again at once, its input token a placeholder (``PLACEHOLDER_TOKEN_ID``
  in the chunk's ``token_ids``) that the runner side fills with the token it sampled.
* A request whose known plus in-flight tokens already reach ``max_tokens`` (or
  ``max_model_len``) is not scheduled again: the step in flight ends it (vLLM's rule).
* ``update_from_output`` turns a placeholder into the sampled token; prefix blocks are cached
  only up to the tokens whose K/V is computed *and* known: ``num_computed_tokens -
  num_output_placeholders``.
* A stop that only the sampled token reveals (eos, a stop token, a stop string, a grammar's
  end) is found one step late: the step already in flight computed a token for a request that
  has finished; that token is dropped (``discarded`` lists them per step).
* A request preempted while its step is in flight still receives that step's token when it
  arrives (vLLM delivers it), which may finish it in the waiting queue.

Invariants between steps (``check_invariants``): running and waiting hold exactly the
unfinished requests; a running request has ``num_computed_tokens - num_output_placeholders <
num_tokens``, at most one placeholder (one step in flight) and ``ceil(num_computed_tokens /
block_size)`` blocks; a waiting one holds no blocks and no computed tokens.
"""

from __future__ import annotations

from collections.abc import Mapping

from workbench.core.request_events import RequestFirstToken
from workbench.core.sched.output import ScheduledRequest, SchedulerOutput, SpecDecodeResult
from workbench.core.sched.scheduler import Scheduler
from workbench.request import Request, RequestStatus

#: The input token of a chunk whose token is still being sampled (vLLM uses -1 too).
PLACEHOLDER_TOKEN_ID = -1


def needs_output_history(request: Request) -> bool:
    """Whether sampling this request reads its own earlier output tokens on the host
    (penalties, ``min_tokens``, bad words, per-request logits processors): then a step that
    samples it cannot start before the previous step's tokens are in."""
    sp = request.sampling_params
    return bool(sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty
                or sp.min_tokens or sp.bad_words_token_ids or sp.logits_processors)


class AsyncScheduler(Scheduler):
    """The scheduler of ``async_scheduling`` (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: Per step index: the requests whose token from that step was dropped because an
        #: earlier step finished them (a stop found one step late).
        self.discarded: dict[int, tuple[str, ...]] = {}
        #: Every request sampling on a placeholder is pending (set by an engine whose
        #: batch-level logits processors read each row's output tokens).
        self.always_pending = False

    def _num_new_tokens(self, request: Request) -> int:
        placeholders = request.num_output_placeholders
        if placeholders:
            known = request.num_tokens + placeholders
            max_tokens = request.sampling_params.max_tokens
            if known >= self.max_model_len or (
                    max_tokens is not None and request.num_output_tokens + placeholders >= max_tokens):
                return 0  # the step in flight ends it
        return request.num_tokens + placeholders - request.num_computed_tokens

    def _chunk(self, request: Request, num_new: int, num_hit: int,
               spec: tuple[int, ...] = ()) -> ScheduledRequest:
        placeholders = request.num_output_placeholders
        if not placeholders:
            return super()._chunk(request, num_new, num_hit, spec)
        start = request.num_computed_tokens
        end = start + num_new
        known = request.num_tokens
        token_ids = tuple(request.token_ids_slice(start, min(end, known)))
        request.is_prefill_chunk = end != known + placeholders
        return ScheduledRequest(
            request_id=request.request_id,
            num_computed_tokens=start,
            num_new_tokens=num_new,
            token_ids=token_ids + (PLACEHOLDER_TOKEN_ID,) * (end - max(start, known)),
            block_ids=self.kv_cache.block_ids(request.request_id),
            is_prefill=num_new > 1 or start < request.num_prompt_tokens,
            samples=end == known + placeholders,
            num_cached_tokens=num_hit,
            lora_name=request.lora_name,
        )

    def schedule(self) -> SchedulerOutput:
        """The base schedule, then vLLM's ``_update_after_schedule``: each chunk's tokens count
        as computed, and a sampling chunk adds a placeholder."""
        output = super().schedule()
        requests = self.requests
        for chunk in output.scheduled:
            request = requests[chunk.request_id]
            request.num_computed_tokens += chunk.num_new_tokens
            if chunk.samples:
                request.num_output_placeholders += 1
        return output

    def pending_output_request_ids(self, scheduler_output: SchedulerOutput) -> tuple[str, ...]:
        """The requests of ``scheduler_output`` that sample on top of a token still in flight
        and need it on the host first (a grammar to advance, or their output history: see
        :func:`needs_output_history`); vLLM's ``pending_structured_output_tokens`` widened."""
        pending = []
        for chunk in scheduler_output.scheduled:
            if chunk.samples and PLACEHOLDER_TOKEN_ID in chunk.token_ids:
                request = self.requests.get(chunk.request_id)
                if request is not None and (self.always_pending or needs_output_history(request)
                                            or request.sampling_params.structured_outputs is not None):
                    pending.append(chunk.request_id)
        return tuple(pending)

    def add_request(self, request: Request) -> None:
        """As the base's; a pooling request is refused (it samples nothing to overlap)."""
        if request.pooling_params is not None:
            raise ValueError(f"request {request.request_id!r}: pooling requests are not supported "
                             "with async scheduling.")
        super().add_request(request)

    def _apply_chunks(self, scheduler_output: SchedulerOutput, sampled_token_ids: Mapping[str, int],
                      spec_decode: Mapping[str, SpecDecodeResult] | None, now: float) -> tuple[list[Request], list[Request]]:
        """The base's pass over the chunks (see ``update_from_output``), one step behind: each
        sampling chunk's placeholder becomes its token; stop conditions as the base; blocks
        cached up to the known computed tokens. A request finished since the step was
        scheduled gets nothing (its token is recorded in ``discarded``); one preempted since
        gets its token."""
        if spec_decode:
            raise ValueError("speculative decoding is not supported with async scheduling.")
        kv, requests = self.kv_cache, self.requests
        got_token: list[Request] = []
        discarded: list[str] = []
        finished: list[Request] = []  # the running ones it finished
        for chunk in scheduler_output.scheduled:
            rid = chunk.request_id
            request = requests.get(rid)
            if request is None:
                if chunk.samples and rid in sampled_token_ids:
                    discarded.append(rid)
                continue
            running = request.status is RequestStatus.RUNNING
            if not chunk.samples:
                if running:
                    kv.cache_blocks(request, request.num_computed_tokens - request.num_output_placeholders)
                continue
            try:
                token = sampled_token_ids[rid]
            except KeyError:
                raise ValueError(f"sampled_token_ids has no token for request {rid!r}, which "
                                 f"sampled at step {scheduler_output.step}.") from None
            request.num_output_placeholders -= 1
            request.output_token_ids.append(token)
            status = self._check_stop(request, token)
            if running:
                kv.cache_blocks(request, min(request.num_computed_tokens - request.num_output_placeholders,
                                             request.num_tokens))
            if request.first_token_time is None:
                request.first_token_time = now
                if self._events is not None:
                    self._events.append(RequestFirstToken(rid, scheduler_output.step, now))
            kv.update_block_hashes(request)
            if status is not None:
                if running:
                    finished.append(request)
                else:  # preempted while its step was in flight: leaves the waiting queue
                    self.waiting.remove(request)
                self._finish(request, status, scheduler_output.step, now)
            got_token.append(request)
        if discarded:
            self.discarded[scheduler_output.step] = tuple(discarded)
        return got_token, finished

    def update_draft_token_ids(self, draft_token_ids) -> None:
        if draft_token_ids:
            raise ValueError("speculative decoding is not supported with async scheduling.")

    def check_invariants(self, scheduler_output: SchedulerOutput | None = None) -> None:
        """As the base's (the KV cache's own included), with the placeholders counted."""
        scheduled = ({c.request_id: c.num_new_tokens for c in scheduler_output.scheduled}
                     if scheduler_output else {})
        self.kv_cache.check_invariants(self.requests.values(), scheduled)
        running = [r.request_id for r in self.running]
        waiting = [r.request_id for r in self.waiting]
        assert len(set(running)) == len(running) and len(set(waiting)) == len(waiting), (
            f"a request is twice in a queue: running {running}, waiting {waiting}")
        assert not set(running) & set(waiting), f"both running and waiting: {set(running) & set(waiting)}"
        assert set(running) | set(waiting) == set(self.requests), (
            f"running+waiting {sorted(set(running) | set(waiting))} != unfinished {sorted(self.requests)}")
        assert len(running) <= self.max_num_seqs, f"{len(running)} running > max_num_seqs={self.max_num_seqs}"
        for r in self.running:
            assert r.status is RequestStatus.RUNNING, f"{r.request_id!r} in running with status {r.status.name}"
            assert 0 <= r.num_output_placeholders <= 1, (
                f"{r.request_id!r} has {r.num_output_placeholders} placeholders (one step in flight at most)")
            assert r.num_computed_tokens - r.num_output_placeholders < r.num_tokens + (r.request_id in scheduled), (
                f"running {r.request_id!r}: num_computed_tokens={r.num_computed_tokens} with "
                f"{r.num_output_placeholders} placeholders is past its {r.num_tokens} known tokens")
        for r in self.waiting:
            assert r.num_computed_tokens == 0, f"waiting {r.request_id!r} has {r.num_computed_tokens} computed tokens"
            assert not self.kv_cache.block_table(r.request_id), f"waiting {r.request_id!r} holds blocks"
