"""Scheduler: vLLM v1's unified step over a paged KV cache.

There is no prefill or decode phase. Each ``schedule()`` moves requests'
``num_computed_tokens`` toward their ``num_tokens`` within a token budget
(``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``):

1. Running requests, in order, each get ``min(num_tokens - num_computed_tokens, budget)``
   tokens. When the KV cache cannot hold them, the policy picks a victim among the running
   requests, which is preempted by recompute (blocks freed, ``num_computed_tokens = 0``,
   status PREEMPTED, back to the front of the waiting queue); a victim scheduled earlier
   in this step is unscheduled and its tokens return to the budget. If the victim is the
   request itself, the running pass stops.
2. Only if nothing was preempted: waiting requests in policy order, while the budget and
   ``max_num_seqs`` allow. A request (re)entering looks up the prefix cache first; the
   rest of its tokens are chunked to the budget (chunked prefill), or -- with chunked
   prefill off -- it is admitted only when all of them fit this step's remaining budget.
   The pass stops at the first request that does not fit (no overtaking). A request in
   WAITING_FOR_FSM (its grammar still compiling) is passed over, keeping its place. With
   ``max_loras`` set (LoRA enabled), a batch holds at most that many distinct adapters: a
   waiting request whose adapter is not in the batch when the batch's and the pinned adapters
   fill ``max_loras`` is passed over the same way, as vLLM does, and the step's ``lora_skipped_request_ids`` name it.

A chunk samples (``samples``) iff it reaches the last known token. ``is_prefill`` is True
iff the chunk holds a prompt token or more than one token; a decode chunk is exactly one
generated token. ``update_from_output`` finishes the rows the runner failed, appends sampled
tokens, caches newly full blocks, applies the stop conditions that need no text and frees
finished requests; ``finish_requests`` ends the rest (aborts, and the stop strings and errors
the output processor reports). The scheduler is the only writer of a request's status.

Structured outputs (vLLM V1's split): the scheduler owns the ``StructuredOutputManager``. A
constrained request whose grammar is still compiling enters WAITING_FOR_FSM; each
``schedule()`` first polls the compiles (waiting briefly when nothing else could run), sets the
ready ones WAITING and finishes the failed ones with an error; ``get_grammar_bitmask`` masks
the step's constrained rows; ``update_from_output`` advances the grammars on the new tokens
(a grammar that ended stops its request, a refused token ends it with an error);
``update_draft_token_ids`` keeps the drafts' grammar-valid prefix. The error of every request
a step finished with FINISHED_ERROR is in ``finished_request_errors``.

Speculative decoding: a running request's ``spec_token_ids`` (drafts from the proposer,
``update_draft_token_ids``, which drops those handed to a request whose last chunk stopped
short of its last known token, as vLLM does) are scheduled after its last known token when its
chunk reaches it, as far as the budget, ``max_tokens`` and ``max_model_len`` allow; they take budget and KV
slots like any token (dropped first when the cache is short, before anyone is preempted).
``update_from_output`` advances the request by the accepted drafts plus one and frees the
blocks that held only rejected ones.

Invariants (``check_invariants``, between steps): running and waiting are disjoint and
hold exactly the unfinished requests; a running request has ``1 <= num_computed_tokens <
num_tokens`` and a block table of ``ceil(num_computed_tokens / block_size)`` blocks; a
waiting one has no blocks, no drafts and ``num_computed_tokens == 0``; a chunk's drafts
follow its request's last known token; plus the KV cache's own.
Per-step work is O(scheduled requests + their block tables), never O(all blocks).

Each step's why -- the reason of every request it did not fully schedule, its preemptions and
its prefix lookups -- is ``SchedulerOutput.explanation`` (:mod:`workbench.core.sched.explain`).
A policy's ``seats_held`` counts seats of ``max_num_seqs`` besides the running (0 built in).

With ``record_events`` the scheduler logs each request's life (arrival, chunks, prefix
hits, preemptions, resumes, first token, finish: :mod:`workbench.core.request_events`);
``take_events()`` drains the log.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from workbench.core.kv_cache_manager import KVCacheManager
from workbench.core.sched.explain import StepExplainer
from workbench.core.sched.policies import SchedulingPolicy, get_policy
from workbench.core.sched.remote_kv import RemoteKVMixin
from workbench.core.sched.request_queue import WaitingQueue
from workbench.core.request_events import (
    RequestArrived,
    RequestEvent,
    RequestFinished,
    RequestFirstToken,
    RequestPrefixHit,
    RequestPreempted,
    RequestResumed,
    RequestScheduled,
)
from workbench.core.sched.output import ScheduledRequest, SchedulerOutput, SpecDecodeResult
from workbench.request import Request, RequestStatus

#: The longest ``schedule()`` waits for a grammar compile when nothing else could run (instead
#: of returning an empty step at once, which a driver would spin on).
COMPILE_WAIT_S = 0.05


class Scheduler(RemoteKVMixin):
    """Decides each step's batch; owns the waiting and running queues (see module docstring)."""

    def __init__(
        self,
        kv_cache: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: str | SchedulingPolicy = "fcfs",
        record_events: bool = False,
        clock: Callable[[], float] = time.monotonic,
        max_loras: int | None = None,
        structured_output_manager=None,
        connector=None,
    ):
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and an output), got {max_model_len}.")
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        if max_loras is not None and (not isinstance(max_loras, int) or max_loras < 1):
            raise ValueError(f"max_loras must be an integer >= 1, got {max_loras!r}.")
        #: Most distinct LoRA adapters in one batch (None: LoRA disabled).
        self.max_loras = max_loras
        #: Adapters pinned to their device slot (``LLMEngine.pin_lora``): they count against
        #: ``max_loras`` in every step, in the batch or not.
        self.pinned_loras: set[str] = set()
        self.policy = get_policy(policy)
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_count = 0  # schedule() calls so far; the next output's step index
        self._finished_ids: list[str] = []  # since the last schedule()
        self._events: list[RequestEvent] | None = [] if record_events else None
        #: Source of every timestamp the scheduler writes (requests' scheduled / first-token /
        #: finished times, events): ``time.monotonic`` for a real engine, a simulated clock
        #: for a simulated one.
        self.clock = clock
        #: The grammars of constrained requests (a ``StructuredOutputManager``), else None.
        self.structured_output_manager = structured_output_manager
        self._errors: dict[str, str] = {}  # finished with an error since the last schedule()
        #: Explains each step (``SchedulerOutput.explanation``: :mod:`workbench.core.sched.explain`);
        #: ``explainer.detach()`` then None records no why.
        self.explainer: StepExplainer | None = StepExplainer(kv_cache)
        self._init_remote_kv(connector)  # the KV connector's scheduler side (remote_kv.py)

    def take_events(self) -> tuple[RequestEvent, ...]:
        """The request events since the previous call, oldest first (empty unless recording)."""
        if not self._events:
            return ()
        events, self._events = tuple(self._events), []
        return events

    # -------------------------------------------------------------- requests
    def check_fits(self, rid: str, n_prompt: int, max_tokens: int | None, *,
                   pooling: bool = False) -> None:
        """ValueError (naming ``rid`` and the limit) unless a request of ``n_prompt`` prompt
        tokens and up to ``max_tokens`` outputs could ever be served here, alone.

        Rejected: an empty prompt; a prompt of ``>= max_model_len`` tokens (one position is
        needed for an output; a pooling request, which has none, may fill the context); with
        chunked prefill off, a prompt longer than ``max_num_batched_tokens``; a request whose
        largest KV footprint -- prompt plus ``max_tokens - 1`` generated tokens, capped by
        ``max_model_len - 1`` -- needs more blocks than the whole pool (it could never finish,
        even alone). :meth:`add_request` asks it of every request; a beam search asks it once,
        before its first step (its step requests grow to the prompt plus ``max_tokens - 1``)."""
        if n_prompt == 0:
            raise ValueError(f"request {rid!r}: the prompt must contain at least one token.")
        if n_prompt >= self.max_model_len + pooling:  # pooling: no output
            raise ValueError(
                f"request {rid!r}: the prompt has {n_prompt} tokens but max_model_len="
                f"{self.max_model_len} allows at most {self.max_model_len - 1} prompt tokens "
                f"(one position is needed for the first generated token)."
            )
        if not self.enable_chunked_prefill and n_prompt > self.max_num_batched_tokens:
            raise ValueError(
                f"request {rid!r}: the prompt has {n_prompt} tokens but max_num_batched_tokens="
                f"{self.max_num_batched_tokens} and chunked prefill is disabled; enable chunked "
                f"prefill or raise max_num_batched_tokens."
            )
        kv = self.kv_cache
        if kv.num_blocks_for(n_prompt) > kv.num_blocks:
            raise ValueError(
                f"request {rid!r}: the prompt has {n_prompt} tokens, which need "
                f"{kv.num_blocks_for(n_prompt)} KV blocks of {kv.block_size}, but the KV cache has "
                f"num_blocks={kv.num_blocks}."
            )
        final_len = self.max_model_len if max_tokens is None else min(n_prompt + max_tokens, self.max_model_len)
        kv_tokens = final_len - 1  # the last sampled token's K/V is never computed
        if kv.num_blocks_for(kv_tokens) > kv.num_blocks:
            raise ValueError(
                f"request {rid!r}: prompt ({n_prompt} tokens) plus up to {final_len - n_prompt} "
                f"generated tokens (max_tokens={max_tokens}, max_model_len={self.max_model_len}) "
                f"needs up to {kv.num_blocks_for(kv_tokens)} KV blocks of {kv.block_size}, but the "
                f"KV cache has num_blocks={kv.num_blocks}; lower max_tokens or enlarge the cache."
            )

    def add_request(self, request: Request) -> None:
        """Queue a new request, or raise ValueError if it is not fresh or can never be served
        (:meth:`check_fits`)."""
        rid = request.request_id
        if rid in self.requests or rid in self.held_for_transfer:
            raise ValueError(f"request_id {rid!r} is already in the scheduler.")
        if (request.status not in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_FSM)
                or request.num_computed_tokens or request.output_token_ids):
            raise ValueError(f"request {rid!r} must be fresh (WAITING or WAITING_FOR_FSM, nothing "
                             "computed or generated).")
        n_prompt = request.num_prompt_tokens
        self.check_fits(rid, n_prompt, request.sampling_params.max_tokens,
                        pooling=request.pooling_params is not None)
        self._check_remote_kv(request)
        self.kv_cache.update_block_hashes(request)
        grammars = self.structured_output_manager
        if grammars is not None and grammars.add_request(request):
            request.status = RequestStatus.WAITING_FOR_FSM
        self.requests[rid] = request
        self.waiting.add(request)
        if self._events is not None:
            self._events.append(
                RequestArrived(rid, self.step_count, request.arrival_time, n_prompt, request.priority)
            )

    def finish_requests(
        self, request_ids: str | Iterable[str], status: RequestStatus, *, now: float | None = None
    ) -> None:
        """Finish requests in any state and free their blocks: aborts, and what the output
        processor found in a step's output (stop strings, errors). ``now``: the finish time
        (default: the clock now). Unknown or already finished ids are ignored. A mapping of
        ids to messages with FINISHED_ERROR keeps each message in ``finished_request_errors``."""
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status.name}.")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        now = self.clock() if now is None else now
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            error = request_ids.get(rid) if isinstance(request_ids, Mapping) else None
            self._finish(request, status, self.step_count - 1, now, error)

    def finish_from_output(self, request_id: str, status: RequestStatus, *,
                           num_output_tokens: int | None = None, error: str | None = None,
                           now: float | None = None) -> None:
        """Finish a request the output processor ended (vLLM's ``reqs_to_abort``): a stop
        string (FINISHED_STOPPED) keeps the first ``num_output_tokens`` output tokens -- in a
        step that brought several (speculative decoding) the ones after the stop are dropped,
        as one token at a time would have -- and an error (FINISHED_ERROR) keeps ``error`` in
        ``finished_request_errors``. An unknown or finished id is ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if num_output_tokens is not None:
            del request.output_token_ids[num_output_tokens:]
        self.finish_requests({request_id: error} if error is not None else request_id, status, now=now)

    @property
    def finished_request_ids(self) -> tuple[str, ...]:
        """The requests finished since the last ``schedule()`` (the next SchedulerOutput
        reports them), in the order they finished."""
        return tuple(self._finished_ids)

    @property
    def finished_request_errors(self) -> dict[str, str]:
        """{id: message} of the requests finished with an error since the start of the last
        ``schedule()``: a grammar that failed to compile, a row the runner failed, a token
        the grammar refused, a request whose output processing raised."""
        return dict(self._errors)

    # -------------------------------------------------------------- grammars
    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> dict:
        """{request id: its packed token mask} for the constrained rows of the step that
        sample (vLLM's name; see ``StructuredOutputManager.grammar_bitmask``); empty without."""
        grammars = self.structured_output_manager
        return {} if grammars is None else grammars.grammar_bitmask(scheduler_output)

    def take_grammar_step(self):
        """The structured-output work since the last call (the StepRecord keeps it), or None
        without a manager."""
        grammars = self.structured_output_manager
        return None if grammars is None else grammars.take_step(self.requests)

    def _update_grammars(self) -> None:
        """WAITING_FOR_FSM -> WAITING for the requests whose grammar compiled; finish with an
        error those whose compile failed. When only compiling requests are left, wait up to
        ``COMPILE_WAIT_S`` for one, instead of an empty step."""
        grammars = self.structured_output_manager
        if grammars is None or not grammars.compiling:
            return
        if not self.running and all(r.status is RequestStatus.WAITING_FOR_FSM for r in self.waiting):
            grammars.wait_for_compile(timeout=COMPILE_WAIT_S)
        ready, failed = grammars.update_waiting(self.requests)
        for rid in ready:
            if self.requests[rid].status is RequestStatus.WAITING_FOR_FSM:
                self.requests[rid].status = RequestStatus.WAITING
        self.finish_requests(failed, RequestStatus.FINISHED_ERROR)

    def abort_request(self, request_id: str) -> None:
        self.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -------------------------------------------------------------- the step
    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch (see the module docstring) and allocate its KV slots.
        Every time it writes (first scheduled, events) is one clock reading."""
        self._errors = {}
        self._update_grammars()
        if self.connector is not None:
            self._update_waiting_for_remote_kv()
        kv = self.kv_cache
        now = self.clock()
        budget = self.max_num_batched_tokens
        running = self.running
        # request -> its chunk, in running order, built as soon as its slots are allocated:
        # nothing later in the step changes its table (a victim's chunk is dropped)
        running_chunks: dict[Request, ScheduledRequest] = {}
        preempted: list[str] = []

        running_state = RequestStatus.RUNNING  # read several times per running request
        num_new_tokens = self._num_new_tokens
        table_ids, block_size = kv.block_ids_by_request, kv.block_size
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            # A plain decode -- one generated token left to compute, no drafts, no token in
            # flight (async scheduling's hooks see those), a slot for it in its table already --
            # gets the chunk the general path below would give it (_num_new_tokens 1,
            # allocate_slots allocating nothing, _chunk) without their work: nearly every
            # running request, every step.
            start = request.num_computed_tokens
            output = request.output_token_ids
            if (output and start + 1 == len(request.prompt_token_ids) + len(output)
                    and not request.spec_token_ids and not request.num_output_placeholders):
                block_ids = table_ids.get(request.request_id)
                if block_ids is not None and len(block_ids) * block_size > start:
                    request.is_prefill_chunk = False
                    lora = request.lora_request
                    running_chunks[request] = ScheduledRequest(
                        request.request_id, start, 1, (output[-1],), block_ids, False, True, 0,
                        None if lora is None else lora.lora_name)
                    budget -= 1
                    i += 1
                    continue
            num_new = num_new_tokens(request)
            if num_new > budget:
                num_new = budget
            if num_new <= 0:  # async scheduling: its last token is in flight and ends it
                i += 1
                continue
            spec = ()
            if request.spec_token_ids:  # scheduled now (or dropped): the next proposal replaces them
                spec = self._schedulable_spec_tokens(request, num_new, budget)
                request.spec_token_ids = []
            while request.status is running_state and kv.allocate_slots(request, num_new + len(spec)) is None:
                if spec:  # drafts are optional work: drop them before preempting anyone
                    spec = ()
                    continue
                victim = self.policy.pick_victim(running)
                if self.explainer is not None:
                    self.explainer.preempting(victim, request, self.policy, victim in running_chunks)
                del running[running.index(victim)]
                if victim in running_chunks:
                    budget += running_chunks.pop(victim).num_new_tokens
                    i -= 1
                self._preempt(victim, now)
                preempted.append(victim.request_id)
            if request.status is not running_state:  # it was its own victim
                break
            running_chunks[request] = self._chunk(request, num_new + len(spec), 0, spec)
            budget -= num_new + len(spec)
            i += 1

        admitted: list[tuple[Request, int, int]] = []  # (request, new tokens, prefix-hit tokens)
        new_ids: list[str] = []
        resumed_ids: list[str] = []
        lora_skipped: list[str] = []
        # The batch's adapters: every running request is scheduled when this pass runs.
        scheduled_loras = ({r.lora_name for r in running if r.lora_request is not None}
                           if self.max_loras is not None else set())
        held = self.policy.seats_held(self)  # seats the policy counts besides the running
        while not preempted and self.waiting and budget > 0 and len(running) + held < self.max_num_seqs:
            request = self.waiting.peek()
            if request.status in (RequestStatus.WAITING_FOR_FSM, RequestStatus.WAITING_FOR_REMOTE_KVS):
                self.waiting.skip_front()  # vLLM: skipped, not blocking
                continue
            lora_name = request.lora_name
            if (self.max_loras is not None and lora_name is not None
                    and lora_name not in scheduled_loras and lora_name not in self.pinned_loras
                    and len(scheduled_loras | self.pinned_loras) >= self.max_loras):
                # vLLM: skipped, not blocking (a pinned adapter keeps its slot, used or not)
                self.waiting.skip_front()
                lora_skipped.append(request.request_id)
                continue
            if request.num_computed_tokens:  # its prompt's KV came from a peer (remote_kv.py)
                hit_blocks, num_hit = [], request.num_computed_tokens
            else:
                hit_blocks, num_hit = kv.get_computed_blocks(request)
                if self.connector is not None:
                    remote = self._load_remote_kv(request, hit_blocks, num_hit)
                    if remote is None:
                        break
                    if remote:
                        self.waiting.skip_front()
                        continue
            num_new = request.num_tokens - num_hit
            if self.enable_chunked_prefill:
                num_new = min(num_new, budget)
            else:
                # Whole, or -- a resumed request longer than any step -- one full-budget step.
                num_new = min(num_new, self.max_num_batched_tokens)
                if num_new > budget:
                    break
            if kv.allocate_slots(request, num_new, hit_blocks) is None:
                break
            self.waiting.pop()
            resumed = request.status is RequestStatus.PREEMPTED
            (resumed_ids if resumed else new_ids).append(request.request_id)
            if self._events is not None:
                self._log_admission(request, resumed, num_hit if hit_blocks else 0, hit_blocks, now)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                request.num_cached_tokens = num_hit
            running.append(request)
            if lora_name is not None:
                scheduled_loras.add(lora_name)
            admitted.append((request, num_new, num_hit))
            budget -= num_new
        why = None if self.explainer is None else self.explainer.explain_step(
            self, running_chunks, admitted, preempted, lora_skipped, budget, held)
        self.waiting.restore_skipped()

        chunk = self._chunk
        scheduled = [*running_chunks.values(), *[chunk(r, n, hit) for r, n, hit in admitted]]
        output = SchedulerOutput(
            step=self.step_count,
            scheduled=tuple(scheduled),
            new_request_ids=tuple(new_ids),
            resumed_request_ids=tuple(resumed_ids),
            preempted_request_ids=tuple(preempted),
            finished_request_ids=tuple(self._finished_ids),
            token_budget=self.max_num_batched_tokens,
            kv_cache_stats=kv.make_stats(),
            num_free_blocks=kv.num_free_blocks,
            kv_usage=kv.usage,
            lora_skipped_request_ids=tuple(lora_skipped),
            explanation=why,
            kv_connector_metadata=None if self.connector is None else self.connector.build_connector_meta(None),
        )
        if self._events is not None:
            step = output.step
            self._events.extend([
                RequestScheduled(c.request_id, step, now, c.num_computed_tokens, c.num_new_tokens,
                                 c.is_prefill, c.samples)
                for c in scheduled
            ])
        if self.structured_output_manager is not None:  # their last tokens were fed: forget them
            self.structured_output_manager.remove(self._finished_ids)
        self._finished_ids = []
        self.step_count += 1
        return output

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: Mapping[str, int],
        failed_request_ids: Iterable[str] | Mapping[str, str] = (),
        *,
        spec_decode: Mapping[str, SpecDecodeResult] | None = None,
        now: float | None = None,
        kv_connector_output=None,
    ) -> list[Request]:
        """Apply a computed step. First the runner's failed rows (they got no token; a mapping
        gives each one's message) finish with FINISHED_ERROR; then every other scheduled request advances
        ``num_computed_tokens``, caches newly full blocks, appends the sampled token of its
        sampling chunk and stops on eos / stop_token_ids (once ``min_tokens`` are out),
        ``max_tokens`` or ``max_model_len``. Finished requests leave ``running`` and free their
        blocks. Requests finished or aborted since ``schedule()`` are skipped. ``now`` (default:
        the clock now) is the time of every first token and finish this writes.

        A speculating chunk (``spec_token_ids``) appends its accepted drafts
        (``spec_decode[id].num_accepted``; none when absent) and then its sampled token, one
        at a time, stopping at the first stop condition (nothing after it is appended); it
        advances by the accepted drafts plus the last known token, and the blocks that held
        only rejected drafts go back to the pool (the tail block's rejected slots are
        overwritten by the next step). Only full blocks of accepted tokens are cached.
        Then the constrained requests' grammars take the new tokens: a grammar that ended
        stops its request, one that refused a token ends it with an error (the token stays in
        its output, as vLLM's).

        ``kv_connector_output``: the KV connector's finished transfers (see remote_kv.py).

        Returns the requests that got a token, in batch order.
        """
        self._update_from_kv_xfer_finished(kv_connector_output)
        now = self.clock() if now is None else now
        self.finish_requests(failed_request_ids, RequestStatus.FINISHED_ERROR, now=now)
        got_token, finished = self._apply_chunks(scheduler_output, sampled_token_ids, spec_decode, now)
        grammars = self.structured_output_manager
        if grammars is not None:
            ended, refused = grammars.accept_tokens(got_token)
            self.finish_requests(ended, RequestStatus.FINISHED_STOPPED, now=now)
            self.finish_requests(refused, RequestStatus.FINISHED_ERROR, now=now)
        for request in finished:  # O(finished) removals, not a pass over every running request
            self.running.remove(request)
        return got_token

    def _apply_chunks(self, scheduler_output: SchedulerOutput, sampled_token_ids: Mapping[str, int],
                      spec_decode: Mapping[str, SpecDecodeResult] | None, now: float) -> tuple[list[Request], list[Request]]:
        """``update_from_output``'s pass over the step's chunks: the requests that got a token,
        in batch order, and the running requests it finished (still in ``running``: the caller
        removes them). A chunk without drafts (every decode) takes the short path: advance by
        its tokens, append its token, check the stop, cache its blocks."""
        cache_blocks, check_stop = self.kv_cache.cache_blocks, self._check_stop  # per chunk
        requests, running_state, step = self.requests, RequestStatus.RUNNING, scheduler_output.step
        max_model_len = self.max_model_len
        got_token: list[Request] = []
        finished: list[Request] = []
        for chunk in scheduler_output.scheduled:
            rid = chunk.request_id
            request = requests.get(rid)
            start = chunk.num_computed_tokens
            if request is None or request.status is not running_state or request.num_computed_tokens != start:
                continue
            num_computed = start + chunk.num_new_tokens
            if not chunk.samples:
                request.num_computed_tokens = num_computed
                cache_blocks(request, num_computed)
                continue
            if request.pooling_params is not None:  # prefill-only: pooled, done
                request.num_computed_tokens = num_computed
                cache_blocks(request, num_computed)
                self._finish(request, RequestStatus.FINISHED_STOPPED, step, now)
                finished.append(request)
                continue
            try:
                token = sampled_token_ids[rid]
            except KeyError:
                raise ValueError(
                    f"sampled_token_ids has no token for request {rid!r}, which sampled at step {step}."
                ) from None
            if chunk.spec_token_ids:
                status = self._accept_drafts(request, chunk, token, spec_decode, step)
            else:
                request.num_computed_tokens = num_computed
                output = request.output_token_ids
                output.append(token)
                # _check_stop's no-stop case, tested inline first (nearly every token): no stop
                # token, room left under max_tokens and max_model_len. Else it decides.
                params = request.sampling_params
                max_tokens, num_output = params.max_tokens, len(output)
                if (token != request.eos_token_id and not params.stop_token_ids
                        and (max_tokens is None or num_output < max_tokens)
                        and len(request.prompt_token_ids) + num_output < max_model_len):
                    status = None
                else:
                    status = check_stop(request, token)
                cache_blocks(request, num_computed)
            if request.first_token_time is None:
                request.first_token_time = now
                if self._events is not None:
                    self._events.append(RequestFirstToken(rid, step, now))
            if status is not None:
                self._finish(request, status, step, now)
                finished.append(request)
            got_token.append(request)
        return got_token, finished

    def _accept_drafts(self, request: Request, chunk: ScheduledRequest, token: int,
                       spec_decode: Mapping[str, SpecDecodeResult] | None, step: int) -> RequestStatus | None:
        """``_apply_chunks`` for a chunk that verified drafts: advance by the accepted drafts
        plus the last known token (not the rejected drafts); append the accepted drafts then
        ``token``, one at a time, up to the first stop (returned); cache the full blocks of
        accepted tokens; release the blocks that held only rejected ones."""
        drafts = chunk.spec_token_ids
        result = (spec_decode or {}).get(request.request_id)
        num_accepted = 0 if result is None else result.num_accepted
        if not 0 <= num_accepted <= len(drafts):
            raise ValueError(f"request {request.request_id!r}: {num_accepted} drafts accepted of "
                             f"{len(drafts)} scheduled at step {step}.")
        request.num_computed_tokens = chunk.num_computed_tokens + chunk.num_new_tokens - len(drafts) + num_accepted
        status = None
        for new_token in (*drafts[:num_accepted], token):
            request.output_token_ids.append(new_token)
            status = self._check_stop(request, new_token)
            if status is not None:
                break
        # K/V exist up to num_computed_tokens; a stop inside the accepted run ends the tokens earlier.
        self.kv_cache.cache_blocks(request, min(request.num_computed_tokens, request.num_tokens))
        if status is None:
            self.kv_cache.free_unneeded_blocks(request)
        return status

    def update_draft_token_ids(self, draft_token_ids: Mapping[str, Sequence[int]]) -> None:
        """vLLM's name: set the drafts the proposer made for running requests (the next
        ``schedule()`` verifies what fits of them); other ids are ignored, and so are drafts
        for a request whose last chunk stopped part-way through its prompt (vLLM drops those:
        ``is_prefill_chunk``), which also loses any drafts it held. A constrained request keeps
        the prefix of its drafts that its grammar accepts (vLLM's ``validate_tokens``)."""
        grammars = self.structured_output_manager
        for rid, drafts in draft_token_ids.items():
            request = self.requests.get(rid)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if request.is_prefill_chunk:
                request.spec_token_ids = []
            elif grammars is None:
                request.spec_token_ids = list(drafts)
            else:
                request.spec_token_ids = list(drafts[:grammars.validate_tokens(rid, list(drafts))])

    # -------------------------------------------------------------- helpers
    def _num_new_tokens(self, request: Request) -> int:
        """Tokens a running request still needs computed (the AsyncScheduler counts its
        placeholders too)."""
        return len(request.prompt_token_ids) + len(request.output_token_ids) - request.num_computed_tokens

    def _schedulable_spec_tokens(self, request: Request, num_new: int, budget: int) -> tuple[int, ...]:
        """The request's drafts this step can verify: only when its chunk reaches the last
        known token, within the budget left, and no more than could be emitted (all accepted
        plus the bonus token stay within ``max_tokens`` and ``max_model_len``)."""
        drafts = request.spec_token_ids
        if not drafts or request.num_computed_tokens + num_new != request.num_tokens:
            return ()
        room = min(budget - num_new, self.max_model_len - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return tuple(drafts[: max(0, room)])

    def _chunk(self, request: Request, num_new: int, num_hit: int,
               spec: tuple[int, ...] = ()) -> ScheduledRequest:
        """The request's ScheduledRequest for ``num_new`` tokens (``spec``: the drafts among
        them), and its ``is_prefill_chunk`` (the chunk stops short of its last known token).
        Plain decodes take the running pass's short path; a decode here (one that needed a new
        block) still skips the token slice."""
        start = request.num_computed_tokens
        end = start + num_new - len(spec)  # known tokens; the drafts follow
        prompt, output = request.prompt_token_ids, request.output_token_ids
        num_prompt = len(prompt)
        samples = end == num_prompt + len(output)
        request.is_prefill_chunk = not samples
        if end - start == 1 and start >= num_prompt:  # a decode: its one known token
            token_ids = (output[start - num_prompt],)
            is_prefill = False
        else:
            token_ids = tuple(request.token_ids_slice(start, end))
            is_prefill = end - start > 1 or start < num_prompt
        lora = request.lora_request
        return ScheduledRequest(request.request_id, start, num_new, token_ids + spec if spec else token_ids,
                                self.kv_cache.block_ids(request.request_id), is_prefill, samples, num_hit,
                                None if lora is None else lora.lora_name, spec)

    def _log_admission(self, request: Request, resumed: bool, num_hit: int, hit_blocks, now: float) -> None:
        rid = request.request_id
        if resumed:
            self._events.append(RequestResumed(rid, self.step_count, now, num_hit))
        if num_hit:
            self._events.append(
                RequestPrefixHit(rid, self.step_count, now, num_hit, tuple(b.block_id for b in hit_blocks))
            )

    def _preempt(self, request: Request, now: float) -> None:
        if self._events is not None:
            self._events.append(
                RequestPreempted(
                    request.request_id, self.step_count, now,
                    self.kv_cache.block_ids(request.request_id), request.num_computed_tokens,
                )
            )
        self.kv_cache.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.add_preempted(request)

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:  # (an eos of None matches no token)
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens
        if max_tokens is not None and num_output >= max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if len(request.prompt_token_ids) + num_output >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, request: Request, status: RequestStatus, step: int, now: float,
                error: str | None = None) -> None:
        """Mark finished (at ``step``, time ``now``; ``error``: the message of an error finish),
        forget, free blocks. The caller removes it from its queue. The one place
        a request's finish status is written."""
        request.status = status
        if error is not None:
            self._errors[request.request_id] = error
        request.finished_time = now
        if self._events is not None:
            self._events.append(
                RequestFinished(request.request_id, step, request.finished_time, status.finish_reason,
                                request.num_output_tokens,
                                request.pooling_params is not None and status is RequestStatus.FINISHED_STOPPED)
            )
        del self.requests[request.request_id]
        if self.connector is None or not self._connector_finished(request):
            self.kv_cache.free(request)
        request.spec_token_ids = []
        self._finished_ids.append(request.request_id)

    # ------------------------------------------------------------ invariants
    def check_invariants(self, scheduler_output: SchedulerOutput | None = None) -> None:
        """Raise AssertionError naming the first broken invariant. Call between steps, or
        right after ``schedule()`` passing its output (tables then cover the scheduled tokens)."""
        scheduled = (
            {c.request_id: c.num_new_tokens for c in scheduler_output.scheduled} if scheduler_output else {}
        )
        scheduled = {**scheduled, **self.remote_kv_tokens}  # blocks for tokens in flight
        self.kv_cache.check_invariants([*self.requests.values(), *self.held_for_transfer.values()], scheduled)
        running = [r.request_id for r in self.running]
        waiting = [r.request_id for r in self.waiting]
        assert len(set(running)) == len(running), f"a request is twice in running: {running}"
        assert len(set(waiting)) == len(waiting), f"a request is twice in waiting: {waiting}"
        both = set(running) & set(waiting)
        assert not both, f"requests both running and waiting: {sorted(both)}"
        assert set(running) | set(waiting) == set(self.requests), (
            f"running+waiting {sorted(set(running) | set(waiting))} != unfinished {sorted(self.requests)}"
        )
        assert len(running) <= self.max_num_seqs, f"{len(running)} running > max_num_seqs={self.max_num_seqs}"
        if self.max_loras is not None:
            loras = {r.lora_name for r in self.running if r.lora_request is not None} | self.pinned_loras
            assert len(loras) <= self.max_loras, (
                f"running requests use {len(loras)} adapters {sorted(loras)} > max_loras={self.max_loras}")
        for r in self.running:
            assert r.status is RequestStatus.RUNNING, f"{r.request_id!r} in running with status {r.status.name}"
            lo = 0 if r.request_id in scheduled else 1
            assert lo <= r.num_computed_tokens < r.num_tokens, (
                f"running {r.request_id!r}: num_computed_tokens={r.num_computed_tokens} not in "
                f"[{lo}, num_tokens={r.num_tokens})"
            )
        for c in scheduler_output.scheduled if scheduler_output else ():
            k = len(c.spec_token_ids)
            if k:
                r = self.requests.get(c.request_id)
                assert c.samples and c.token_ids[-k:] == c.spec_token_ids, (
                    f"{c.request_id!r}: drafts {list(c.spec_token_ids)} are not the sampling tail of its chunk")
                assert r is None or (c.seq_len - k == r.num_tokens and r.num_tokens + k < self.max_model_len), (
                    f"{c.request_id!r}: {k} drafts do not follow its {r.num_tokens} known tokens "
                    f"within max_model_len={self.max_model_len}")
        for rid, r in self.held_for_transfer.items():
            assert r.is_finished and rid not in self.requests, f"held {rid!r} is not finished"
        for r in self.waiting:
            assert not r.spec_token_ids, f"waiting {r.request_id!r} holds drafts {r.spec_token_ids}"
            if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS or (
                    r.num_computed_tokens and r.status is RequestStatus.WAITING and self.connector):
                assert r.status is not RequestStatus.WAITING_FOR_REMOTE_KVS or (
                    r.num_computed_tokens == 0 and r.request_id in self.remote_kv_tokens), (
                    f"{r.request_id!r} waits for remote KV with {r.num_computed_tokens} computed tokens")
                continue  # its blocks (remote KV) are checked with the KV cache's above
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED,
                                RequestStatus.WAITING_FOR_FSM), (
                f"{r.request_id!r} in waiting with status {r.status.name}"
            )
            assert r.num_computed_tokens == 0, f"waiting {r.request_id!r} has {r.num_computed_tokens} computed tokens"
            assert not self.kv_cache.block_table(r.request_id), f"waiting {r.request_id!r} holds blocks"
        for r in self.requests.values():
            assert r.num_tokens < self.max_model_len, (
                f"{r.request_id!r} has {r.num_tokens} tokens >= max_model_len={self.max_model_len} but is unfinished"
            )
            mt = r.sampling_params.max_tokens
            assert mt is None or r.num_output_tokens < mt, (
                f"{r.request_id!r} has {r.num_output_tokens} >= max_tokens={mt} outputs but is unfinished"
            )

    # ------------------------------------------------------------------ repr
    _REPR_MAX = 16

    def _queue_repr(self, requests: Iterable[Request]) -> str:
        items = [f"{r.request_id}:{r.num_computed_tokens}/{r.num_tokens}"
                 + (" (fsm)" if r.status is RequestStatus.WAITING_FOR_FSM else "")
                 for r in requests]
        more = len(items) - self._REPR_MAX
        shown = items[: self._REPR_MAX] + ([f"... +{more} more"] if more > 0 else [])
        return "[" + ", ".join(shown) + "]"

    def __repr__(self) -> str:
        return (
            f"Scheduler(policy={self.policy.name}, step={self.step_count}, "
            f"max_num_seqs={self.max_num_seqs}, max_num_batched_tokens={self.max_num_batched_tokens}, "
            f"running={self._queue_repr(self.running)}, waiting={self._queue_repr(self.waiting)}, "
            f"free_blocks={self.kv_cache.num_free_blocks}/{self.kv_cache.num_blocks})"
        )

    _HTML_MAX_ROWS = 50

    def _repr_html_(self) -> str:
        """The running and waiting queues as one table (computed / total tokens, blocks)."""
        rows = []
        for queue, requests in (("running", self.running), ("waiting", list(self.waiting))):
            for r in requests[: self._HTML_MAX_ROWS]:
                table = self.kv_cache.block_table(r.request_id)
                cells = (
                    queue, r.request_id, r.status.name, r.priority, r.num_prompt_tokens,
                    r.num_output_tokens, f"{r.num_computed_tokens}/{r.num_tokens}",
                    " ".join(map(str, table)) if len(table) <= 16 else f"{len(table)} blocks",
                )
                rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
            if len(requests) > self._HTML_MAX_ROWS:
                rows.append(f'<tr><td colspan="8"><i>... {len(requests) - self._HTML_MAX_ROWS} more {queue}</i></td></tr>')
        head = "".join(
            f"<th>{h}</th>" for h in ("queue", "request", "status", "priority", "prompt", "output", "computed", "blocks")
        )
        return (
            f"<div><b>Scheduler</b> policy={html.escape(self.policy.name)}, step {self.step_count}, "
            f"{len(self.running)} running / {len(self.waiting)} waiting, "
            f"free blocks {self.kv_cache.num_free_blocks}/{self.kv_cache.num_blocks}"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
        )
