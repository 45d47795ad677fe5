"""Why: the structured reason of every request a step did not (fully) schedule, every
preemption and every prefix lookup, as the scheduler decided them.

The scheduler calls a :class:`StepExplainer` twice: ``preempting`` as it picks a victim, and
``explain_step`` once its waiting pass is over (before the requests it set aside return to the
queue). The explainer reads what the pass left -- the budget, the running list, the queue's
head, the KV pool -- so each reason restates the scheduler's own test (vLLM V1's order):

* running pass (``budget > 0``): a running request left out when the budget ran out
  (``TOKEN_BUDGET``) or after a request before it was its own preemption victim
  (``BEHIND_IN_ORDER``); one cut short by the budget (``CHUNKED_PREFILL``); a victim
  (``PREEMPTED``);
* waiting pass, which runs only when nothing was preempted (else ``PREEMPTION_IN_STEP``) and
  stops at the first of: budget spent (``TOKEN_BUDGET``), ``max_num_seqs`` running
  (``MAX_NUM_SEQS``), a head that does not fit -- its KV blocks (``KV_BLOCKS_SHORT``) or,
  chunked prefill off, its whole prompt in the budget left (``CHUNKED_PREFILL``) -- with every
  request after it ``BEHIND_IN_ORDER``; passed over, keeping their place: a compiling grammar
  (``GRAMMAR_COMPILING``), an adapter beyond ``max_loras`` (``MAX_LORAS``).

``REMOTE_KV``: a KV connector's WAITING_FOR_REMOTE_KVS (its blocks are on the way).
Under overload a queue holds thousands: the first ``EXPLAINED_WAITING`` in the queue's order
(and every deferred one) get an entry in ``reasons``; the rest share the step's
``waiting_reason``, so a step's record stays O(running + EXPLAINED_WAITING), not O(waiting). The deferred reasons
(``GRAMMAR_COMPILING``, ``REMOTE_KV``) wait on something other than capacity, as vLLM's
``num_requests_waiting_by_reason`` splits them. Everything here is immutable and compares by
value, so a replayed step carries the same explanation as the recorded one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from workbench.core.prefix_memory import PrefixMemory
from workbench.request import Request, RequestStatus
from workbench.utils.frozen import FrozenDict

#: Waiting requests given an entry of their own in a step's ``reasons``, in the queue's order
#: (deferred ones always): those further back share ``StepExplanation.waiting_reason``.
EXPLAINED_WAITING = 64


class Reason(str, enum.Enum):
    """Why a request was not, or not fully, scheduled in a step."""

    TOKEN_BUDGET = "token_budget"
    MAX_NUM_SEQS = "max_num_seqs"
    KV_BLOCKS_SHORT = "kv_blocks_short"
    MAX_LORAS = "max_loras"
    GRAMMAR_COMPILING = "grammar_compiling"
    REMOTE_KV = "remote_kv"
    BEHIND_IN_ORDER = "behind_in_order"
    CHUNKED_PREFILL = "chunked_prefill"
    PREEMPTED = "preempted"
    PREEMPTION_IN_STEP = "preemption_in_step"

    @property
    def waiting_kind(self) -> str:
        """vLLM's ``reason`` label of a waiting request: "deferred" or "capacity"."""
        return "deferred" if self in (Reason.GRAMMAR_COMPILING, Reason.REMOTE_KV) else "capacity"


# ----------------------------------------------------------------------------- reasons
@dataclass(frozen=True)
class TokenBudgetSpent:
    """The step's ``max_num_batched_tokens`` went to ``spent_by`` ((request id, tokens), in
    scheduling order) before this request's turn."""

    reason: ClassVar[Reason] = Reason.TOKEN_BUDGET
    budget: int
    spent_by: tuple[tuple[str, int], ...]

    def sentence(self) -> str:
        top = sorted(self.spent_by, key=lambda p: -p[1])[:3]
        who = ", ".join(f"{rid} ({n})" for rid, n in top)
        more = len(self.spent_by) - len(top)
        return (f"the token budget of {self.budget} was spent by {len(self.spent_by)} requests"
                + (f", most by {who}" if who else "") + (f" and {more} more" if more > 0 else ""))


@dataclass(frozen=True)
class MaxNumSeqsReached:
    """``num_running`` running plus ``num_seats_held`` seats the policy counts as taken
    (``SchedulingPolicy.seats_held``: deferred requests, for vLLM #53130's gate) filled
    ``max_num_seqs``."""

    reason: ClassVar[Reason] = Reason.MAX_NUM_SEQS
    max_num_seqs: int
    num_running: int
    num_seats_held: int = 0

    def sentence(self) -> str:
        held = (f" and the policy counted {self.num_seats_held} seats held by deferred requests"
                if self.num_seats_held else "")
        running = "1 request was" if self.num_running == 1 else f"{self.num_running} requests were"
        return f"{running} running{held}, max_num_seqs={self.max_num_seqs}"


@dataclass(frozen=True)
class KVBlocksShort:
    """The head of the queue needed ``blocks_needed`` blocks (its new ones, plus its prefix
    hits that sat in the free queue); ``blocks_free`` were free, ``blocks_evictable`` of them
    holding cached content."""

    reason: ClassVar[Reason] = Reason.KV_BLOCKS_SHORT
    blocks_needed: int
    blocks_free: int
    blocks_evictable: int
    num_hit_blocks: int

    def sentence(self) -> str:
        return (f"KV blocks were short: it needed {self.blocks_needed}, {self.blocks_free} were free "
                f"({self.blocks_evictable} of them evictable cached blocks)")


@dataclass(frozen=True)
class MaxLorasReached:
    reason: ClassVar[Reason] = Reason.MAX_LORAS
    lora_name: str
    max_loras: int
    loras_in_batch: tuple[str, ...]

    def sentence(self) -> str:
        return (f"its adapter {self.lora_name!r} would exceed max_loras={self.max_loras} "
                f"(in the batch or pinned: {', '.join(self.loras_in_batch)})")


@dataclass(frozen=True)
class GrammarCompiling:
    reason: ClassVar[Reason] = Reason.GRAMMAR_COMPILING

    def sentence(self) -> str:
        return "its grammar was still compiling (WAITING_FOR_FSM); it kept its place"


@dataclass(frozen=True)
class RemoteKV:
    """Waiting for KV blocks a connector fetches (WAITING_FOR_REMOTE_KVS)."""

    reason: ClassVar[Reason] = Reason.REMOTE_KV
    num_blocks: int = 0

    def sentence(self) -> str:
        return f"it was waiting for {self.num_blocks} KV blocks from a remote instance"


@dataclass(frozen=True)
class BehindInOrder:
    """The pass stopped at ``blocked_by`` (its ``queue``: "waiting" or "running"), which was
    ahead of this request in the policy's order; no request overtakes."""

    reason: ClassVar[Reason] = Reason.BEHIND_IN_ORDER
    blocked_by: str
    queue: str = "waiting"

    def sentence(self) -> str:
        return f"it was behind {self.blocked_by} in the {self.queue} order, which could not be scheduled"


@dataclass(frozen=True)
class ChunkedPrefillLimit:
    """Scheduled ``num_scheduled`` of its ``num_remaining`` known tokens (the budget left),
    or -- ``whole_prompt_required``, chunked prefill off -- none, because all of them had to
    fit the ``budget_left``."""

    reason: ClassVar[Reason] = Reason.CHUNKED_PREFILL
    num_scheduled: int
    num_remaining: int
    budget_left: int
    whole_prompt_required: bool = False

    def sentence(self) -> str:
        if self.whole_prompt_required:
            return (f"chunked prefill is off and its {self.num_remaining} tokens did not fit the "
                    f"{self.budget_left} left in the budget")
        return (f"a chunk of {self.num_scheduled} of its {self.num_remaining} remaining tokens "
                "(the budget left)")


@dataclass(frozen=True)
class Preempted:
    reason: ClassVar[Reason] = Reason.PREEMPTED
    made_room_for: str

    def sentence(self) -> str:
        if self.made_room_for:
            return f"it was preempted to make room for {self.made_room_for}"
        return "it was preempted"


@dataclass(frozen=True)
class PreemptionInStep:
    """A step that preempted admits nobody from the waiting queue (vLLM V1)."""

    reason: ClassVar[Reason] = Reason.PREEMPTION_IN_STEP
    preempted: tuple[str, ...]

    def sentence(self) -> str:
        return f"this step preempted {', '.join(self.preempted)}, so no waiting request was admitted"


WhyNot = (TokenBudgetSpent | MaxNumSeqsReached | KVBlocksShort | MaxLorasReached | GrammarCompiling
          | RemoteKV | BehindInOrder | ChunkedPrefillLimit | Preempted | PreemptionInStep)


def numbers(why) -> dict:
    """A reason's numbers as a plain dict (no ``reason``)."""
    return {k: v for k, v in why.__dict__.items()}


# -------------------------------------------------------------- preemptions and lookups
@dataclass(frozen=True)
class PreemptionExplanation:
    """One preemption by recompute: ``rule`` chose ``request_id`` to make room for
    ``made_room_for`` (the same request when it was its own victim). It lost
    ``num_blocks_freed`` blocks and ``num_tokens_lost`` computed tokens; ``num_cached_blocks``
    of its blocks stay in the prefix cache until evicted, so resuming recomputes at least
    ``recompute_tokens`` and at most ``num_tokens_lost`` tokens. ``unscheduled``: it had been
    scheduled earlier in this step."""

    request_id: str
    made_room_for: str
    rule: str
    num_blocks_freed: int
    num_tokens_lost: int
    num_cached_blocks: int
    recompute_tokens: int
    unscheduled: bool

    def sentence(self) -> str:
        whom = "itself (the rule chose it)" if self.made_room_for == self.request_id \
            else self.made_room_for
        return (f"{self.request_id} was preempted (rule: {self.rule}) to make room for {whom}: "
                f"{self.num_blocks_freed} blocks and {self.num_tokens_lost} computed tokens lost; "
                f"resuming recomputes {self.recompute_tokens} token{'' if self.recompute_tokens == 1 else 's'} "
                f"if its {self.num_cached_blocks} cached blocks survive, else {self.num_tokens_lost}")


class MissCause(str, enum.Enum):
    """Why the first block not reused from the prefix cache was not."""

    NEVER_COMPUTED = "never_computed"
    EVICTED = "evicted"
    OTHER_CACHE_SALT = "other_cache_salt"
    OTHER_LORA = "other_lora"
    PARTIAL_BLOCK = "partial_block"
    LAST_TOKEN = "last_token"  # a full last block: its last token is computed to sample from
    PROMPT_LOGPROBS = "prompt_logprobs"  # the whole prompt is computed for its logprobs


@dataclass(frozen=True)
class PrefixLookup:
    """A request's prefix lookup at admission: ``num_blocks_matched`` of its blocks reused;
    ``miss`` names why block ``miss_block`` (the first not reused) was not; for EVICTED, the
    step that evicted it and the request it was handed to; for OTHER_*, the salt or adapter
    the same tokens were cached under."""

    request_id: str
    num_blocks_matched: int
    num_tokens: int
    miss: MissCause
    miss_block: int
    evicted_at_step: int | None = None
    evicted_for: str | None = None
    cached_under: str | None = None

    def sentence(self) -> str:
        text = f"{self.request_id}'s prefix lookup reused {self.num_blocks_matched} blocks; block {self.miss_block} "
        return text + {
            MissCause.NEVER_COMPUTED: "was never computed before",
            MissCause.EVICTED: f"was evicted at step {self.evicted_at_step} to serve {self.evicted_for}",
            MissCause.OTHER_CACHE_SALT: f"is cached under another cache_salt ({self.cached_under!r})",
            MissCause.OTHER_LORA: f"is cached under another adapter ({self.cached_under!r})",
            MissCause.PARTIAL_BLOCK: "is a partial block (only full blocks are cached)",
            MissCause.LAST_TOKEN: "holds the last token, which is always computed",
            MissCause.PROMPT_LOGPROBS: "and the rest are computed: it asks for prompt logprobs",
        }[self.miss]


@dataclass(frozen=True)
class StepExplanation:
    """One step's why: ``reasons`` (request id -> reason) for every request the step did not
    fully schedule -- of the waiting ones, the first ``EXPLAINED_WAITING`` in order and the
    deferred -- the reason every other waiting request shares (``waiting_reason``, None when
    the queue was served to its end), the step's ``preemptions`` and its admissions'
    ``prefix_lookups``."""

    reasons: FrozenDict
    preemptions: tuple[PreemptionExplanation, ...] = ()
    prefix_lookups: tuple[PrefixLookup, ...] = ()
    waiting_reason: object | None = None


EMPTY = StepExplanation(FrozenDict())


def reason_counts(reasons_by_step: dict, request_id: str, start: int, end: int) -> dict[str, int]:
    """{reason value: steps} of ``request_id`` over steps ``start..end-1``, from
    ``{step: that step's reasons}`` (a span's summary for the timeline and the trace)."""
    counts: dict[str, int] = {}
    for step in range(start, end):
        why = reasons_by_step.get(step, {}).get(request_id)
        if why is not None:
            counts[why.reason.value] = counts.get(why.reason.value, 0) + 1
    return counts


def deferred_requests(scheduler) -> list[Request]:
    """The waiting requests deferred on something other than capacity -- a grammar compiling
    (WAITING_FOR_FSM), KV blocks on their way from a peer (WAITING_FOR_REMOTE_KVS) -- found in
    O(deferred) from those that track them (the grammar manager, the connector's hooks, the
    pass's set-aside requests), never by scanning a queue that may hold thousands."""
    grammars = scheduler.structured_output_manager
    ids = dict.fromkeys(grammars.compiling_request_ids if grammars is not None else ())
    ids.update(dict.fromkeys(scheduler.remote_kv_tokens))
    ids.update(dict.fromkeys(r.request_id for r in scheduler.waiting.set_aside()))
    deferred = (RequestStatus.WAITING_FOR_FSM, RequestStatus.WAITING_FOR_REMOTE_KVS)
    return [r for rid in ids if (r := scheduler.requests.get(rid)) is not None and r.status in deferred]


def explain_stats(scheduler, scheduler_output) -> dict:
    """The SchedulerStats fields of a step's why: the waiting queue split by reason, as it is
    now (vLLM reads the queue's statuses, so the two sum to the waiting count), and the
    step's preemptions by reason."""
    deferred = len(deferred_requests(scheduler))
    by_reason = {"made_room": 0, "own_victim": 0}
    why = scheduler_output.explanation
    for p in why.preemptions if why is not None else ():
        by_reason["own_victim" if p.made_room_for == p.request_id else "made_room"] += 1
    return {"num_waiting_reqs_by_reason": {"capacity": len(scheduler.waiting) - deferred, "deferred": deferred},
            "num_preemptions_by_reason": by_reason}


def victim_rule(policy) -> str:
    """The name of the rule by which ``policy`` picks a preemption victim."""
    from workbench.core.sched import policies

    if type(policy).pick_victim is not policies.SchedulingPolicy.pick_victim:
        return f"{type(policy).__name__}.pick_victim"
    return {policies.PriorityPolicy: "largest priority value, then newest",
            policies.ShortestPromptFirstPolicy: "longest prompt, then newest"}.get(
        type(policy), "newest arrival" if type(policy).sort_key is policies.SchedulingPolicy.sort_key
        else f"last in {type(policy).__name__}'s order")


# ---------------------------------------------------------------------- the collector
class StepExplainer:
    """Fills one :class:`StepExplanation` per ``schedule()`` (see the module docstring). It
    attaches a :class:`PrefixMemory` to the KV cache, which remembers evictions and cached
    contents for the prefix lookups' causes."""

    def __init__(self, kv_cache, memory_capacity: int | None = None) -> None:
        self.kv_cache = kv_cache
        self.memory = PrefixMemory(kv_cache.block_size, memory_capacity or 4 * kv_cache.num_blocks)
        kv_cache.attach_prefix_memory(self.memory)
        self._preemptions: list[PreemptionExplanation] = []
        self._stopped_at: str | None = None  # a running request that was its own victim
        self._deferred_since: dict[str, float] = {}  # id -> arrival, while its grammar compiles
        #: (queue, its version, common reason, {id: reason}, whether statuses were fixed then)
        self._last_waiting: tuple | None = None
        self._deferred_done: list[tuple[str, float]] = []

    def detach(self) -> None:
        """Stop the KV cache telling this explainer's memory anything (to run without a why:
        ``scheduler.explainer.detach(); scheduler.explainer = None``)."""
        self.kv_cache.prefix_memory = self.kv_cache.pool.prefix_memory = None

    def take_deferred_times(self) -> list[tuple[str, float]]:
        """(reason, seconds) of the requests whose deferral ended since the last call: a
        grammar seen compiling at a step and ready at a later one, from its arrival."""
        done, self._deferred_done = self._deferred_done, []
        return done

    def preempting(self, victim: Request, for_request: Request, policy, unscheduled: bool) -> None:
        """``victim`` is about to be preempted for ``for_request`` (called before its blocks go)."""
        kv, bs = self.kv_cache, self.kv_cache.block_size
        table = kv.blocks_of(victim.request_id)
        lost = victim.num_computed_tokens
        cached = 0  # leading computed blocks whose content is in the cache: a resume can reuse them
        for block_hash in victim.block_hashes[:lost // bs]:
            if kv.pool.get_cached_block(block_hash) is None:
                break
            cached += 1
        self._preemptions.append(PreemptionExplanation(
            victim.request_id, for_request.request_id, victim_rule(policy), len(table), lost,
            cached, lost - cached * bs, unscheduled))
        if victim is for_request:
            self._stopped_at = victim.request_id

    def explain_step(self, scheduler, running_chunks: dict, admitted: list, preempted: list,
                     lora_skipped: list, budget: int, seats_held: int = 0) -> StepExplanation:
        """The step's explanation, from the state the scheduler's passes left (``running_chunks``:
        running request -> its ScheduledRequest; ``admitted``: (request, new tokens, prefix-hit
        tokens)). O(running + waiting) dictionary work: a chunk can be cut short only where the
        budget ran out (the last of each pass), and a reason shared by many requests is one
        object."""
        self.memory.step = scheduler.step_count + 1
        preemptions, self._preemptions = tuple(self._preemptions), []
        stopped_at, self._stopped_at = self._stopped_at, None
        reasons: dict[str, object] = {}
        spent = None

        def out_of_budget() -> TokenBudgetSpent:
            nonlocal spent
            if spent is None:
                spent = TokenBudgetSpent(scheduler.max_num_batched_tokens, tuple(
                    [(c.request_id, c.num_new_tokens) for c in running_chunks.values()]
                    + [(r.request_id, n) for r, n, _ in admitted]))
            return spent

        if running_chunks:  # running: the last chunk may be cut short by the budget
            request, chunk = next(reversed(running_chunks.items()))
            n = chunk.num_new_tokens
            remaining = request.num_tokens - request.num_computed_tokens
            if n < remaining:
                reasons[request.request_id] = ChunkedPrefillLimit(n, remaining, n)
        running = scheduler.running
        num_before = len(running) - len(admitted)  # the admitted join the end
        if len(running_chunks) < num_before:  # some running requests were left out
            behind = BehindInOrder(stopped_at, "running") if stopped_at else out_of_budget()
            for request in running[:num_before]:
                if request not in running_chunks:
                    reasons[request.request_id] = behind
        lookups = []
        if admitted:
            request, n, num_hit = admitted[-1]
            if n < request.num_tokens - num_hit:
                reasons[request.request_id] = ChunkedPrefillLimit(n, request.num_tokens - num_hit, n)
            if self.kv_cache.enable_prefix_caching:
                lookups = [self._lookup(r, num_hit) for r, _, num_hit in admitted]
        # Waiting: the reason that stopped the pass, for all; then those with their own.
        waiting = scheduler.waiting
        head = waiting.peek() if waiting else None
        if preempted:
            common = PreemptionInStep(tuple(preempted))
        elif head is None:
            common = None
        elif budget <= 0:
            common = out_of_budget()
        elif len(running) + seats_held >= scheduler.max_num_seqs:
            common = MaxNumSeqsReached(scheduler.max_num_seqs, len(running), seats_held)
        else:
            common = BehindInOrder(head.request_id)
        # Waiting statuses change only while grammars compile (no request is WAITING_FOR_FSM
        # without a pending compile) or with a KV connector.
        grammars = scheduler.structured_output_manager
        statuses_fixed = (grammars is None or not grammars.compiling) and scheduler.connector is None
        last = self._last_waiting
        if (last is not None and last[0] is waiting and last[1] == waiting.version and last[2] == common
                and statuses_fixed and last[4]):
            reasons.update(last[3])  # the same queue held back for the same reason: reuse
        else:
            shared = self._waiting_reasons(scheduler, waiting, common)
            self._last_waiting = (waiting, waiting.version, common, shared, statuses_fixed)
            reasons.update(shared)
        if common is not None and common.reason is Reason.BEHIND_IN_ORDER:
            reasons[head.request_id] = self._head_reason(scheduler, head, budget)
        for p in preemptions:
            if p.request_id in reasons or p.request_id in scheduler.requests:
                reasons[p.request_id] = Preempted(p.made_room_for)
        if lora_skipped:
            loras = tuple(sorted({r.lora_name for r in running if r.lora_request is not None}
                                 | scheduler.pinned_loras))
            for rid in lora_skipped:
                reasons[rid] = MaxLorasReached(scheduler.requests[rid].lora_name, scheduler.max_loras, loras)
        if common is None:  # the queue was served to its end: only the set-aside ones wait
            reasons = {rid: w for rid, w in reasons.items() if w is not None}
        if (grammars is not None and grammars.compiling) or self._deferred_since:  # grammar waits
            self._track_deferred(scheduler, reasons)
        return StepExplanation(FrozenDict(reasons), preemptions, tuple(lookups), common)

    @staticmethod
    def _waiting_reasons(scheduler, waiting, common) -> dict:
        """The waiting requests' own entries: the first EXPLAINED_WAITING in order share
        ``common``; a deferred one anywhere in the queue has its own (grammar, remote KV)."""
        shared = {r.request_id: common for r in waiting.front(EXPLAINED_WAITING)}
        compiling = GrammarCompiling()
        for r in deferred_requests(scheduler):
            shared[r.request_id] = compiling if r.status is RequestStatus.WAITING_FOR_FSM else \
                RemoteKV(len(scheduler.kv_cache.blocks_of(r.request_id)))
        return shared

    def _track_deferred(self, scheduler, reasons: dict) -> None:
        since = self._deferred_since
        for rid, w in reasons.items():
            if w.reason is Reason.GRAMMAR_COMPILING and rid not in since:
                since[rid] = scheduler.requests[rid].arrival_time
        now = None
        for rid in [rid for rid in since if rid not in reasons or reasons[rid].reason is not Reason.GRAMMAR_COMPILING]:
            arrival = since.pop(rid)
            if rid in scheduler.requests:  # not aborted or failed
                now = scheduler.clock() if now is None else now
                self._deferred_done.append(("grammar", max(0.0, now - arrival)))

    def _head_reason(self, scheduler, head: Request, budget: int):
        """Why the waiting pass stopped at ``head`` (budget and seats were left)."""
        kv = self.kv_cache
        hits, num_hit = kv.get_computed_blocks(head)  # the scheduler's own (remembered) lookup
        num_new = head.num_tokens - num_hit
        if not scheduler.enable_chunked_prefill:
            num_new = min(num_new, scheduler.max_num_batched_tokens)
            if num_new > budget:
                return ChunkedPrefillLimit(0, head.num_tokens - num_hit, budget, whole_prompt_required=True)
        else:
            num_new = min(num_new, budget)
        bs = kv.block_size
        new_blocks = -(-(num_new + len(hits) * bs) // bs) - len(hits)
        from_free = sum(1 for b in hits if b.ref_count == 0)
        return KVBlocksShort(new_blocks + from_free, kv.num_free_blocks, kv.pool.num_evictable, len(hits))

    def _lookup(self, request: Request, num_hit: int) -> PrefixLookup:
        """The admitted request's lookup: what matched and why the next block did not."""
        bs = self.kv_cache.block_size
        matched = num_hit // bs
        n = request.num_tokens
        if request.sampling_params.prompt_logprobs is not None:
            return PrefixLookup(request.request_id, 0, n, MissCause.PROMPT_LOGPROBS, 0)
        if matched >= (n - 1) // bs:  # the lookup's cap: nothing more could be reused
            cause = MissCause.LAST_TOKEN if matched < n // bs else MissCause.PARTIAL_BLOCK
            return PrefixLookup(request.request_id, matched, n, cause, matched)
        evicted = self.memory.evictions.get(request.block_hashes[matched])
        if evicted is not None:
            return PrefixLookup(request.request_id, matched, n, MissCause.EVICTED, matched,
                                evicted_at_step=evicted[0], evicted_for=evicted[1])
        under = self.memory.stored_under(request, matched)
        if under is not None and under != (request.cache_salt, request.lora_name):
            if under[0] != request.cache_salt:
                return PrefixLookup(request.request_id, matched, n, MissCause.OTHER_CACHE_SALT, matched,
                                    cached_under=under[0])
            return PrefixLookup(request.request_id, matched, n, MissCause.OTHER_LORA, matched,
                                cached_under=under[1])
        return PrefixLookup(request.request_id, matched, n, MissCause.NEVER_COMPUTED, matched)
