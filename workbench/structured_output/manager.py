"""StructuredOutputManager (vLLM's name): owned by the scheduler, as in vLLM V1; compiles each
constrained request's grammar on its own thread, and per step fills the token bitmask of the
constrained rows that sample and advances their grammars on the tokens they got. With speculative
decoding a constrained request's drafts are cut to the prefix its grammar accepts
(``validate_tokens``), and a verifying request gets one mask row per verified position.

A constrained request waits (the scheduler holds it in WAITING_FOR_FSM) unless its grammar is
already compiled (the cache is keyed by :func:`~workbench.structured_output.backends.grammar_key`,
which names the backend: xgrammar or guidance, per the engine's StructuredOutputsConfig);
``update_waiting`` (at the start of each ``schedule()``) says whose compile is done and whose
failed. The manager reads requests and never writes them: the scheduler owns their status. What it did in a step -- who waits, who still reasons (with a reasoning parser,
a grammar starts once its request's reasoning ends), compile times, each row's allowed-token count
and forced token -- is :class:`StructuredOutputStep`, kept on the StepRecord.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workbench.config import StructuredOutputsConfig
from workbench.core.sched.output import SchedulerOutput
from workbench.reasoning import ReasoningParser
from workbench.request import Request
from workbench.structured_output.backends import grammar_key
from workbench.structured_output.request import GrammarKey
from workbench.utils.frozen import FrozenDict

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class GrammarRow:
    """One constrained row of a step: how many tokens the mask allowed, and the token the
    grammar forced (the only one allowed), if any."""

    num_allowed: int
    forced_token: int | None


@dataclass(frozen=True)
class StructuredOutputStep:
    """A step's structured-output work (immutable, kept on the StepRecord): requests still
    WAITING_FOR_FSM after it; per request whose grammar became ready, its compile's seconds
    (0.0: it was in the cache); the requests that found their grammar cached or already
    compiling (``cache_hits``); the seconds of each compile that ended (one per grammar,
    however many requests share it); the backend of each ready grammar; the rows; and
    ``mask_seconds``, the engine thread's time on grammars in the step (filling the bitmask,
    advancing the matchers)."""

    waiting_for_fsm: tuple[str, ...] = ()
    compiled: Mapping[str, float] = field(default_factory=FrozenDict)
    cache_hits: tuple[str, ...] = ()
    compile_seconds: tuple[float, ...] = field(default=(), compare=False)  # wall clock
    backends: Mapping[str, str] = field(default_factory=FrozenDict)
    rows: Mapping[str, GrammarRow] = field(default_factory=FrozenDict)
    mask_seconds: float = field(default=0.0, compare=False)  # wall clock: not the step's decisions
    #: Constrained requests still reasoning after the step (their grammar not started yet).
    reasoning: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.waiting_for_fsm or self.compiled or self.rows or self.reasoning)


_IDLE_STEP = StructuredOutputStep()


@dataclass
class _StepWork:
    """What the manager did since the last ``take_step`` (the StructuredOutputStep's makings)."""

    compiled: dict[str, float] = field(default_factory=dict)
    cache_hits: list[str] = field(default_factory=list)
    compile_seconds: list[float] = field(default_factory=list)
    backends: dict[str, str] = field(default_factory=dict)
    rows: dict[str, GrammarRow] = field(default_factory=dict)
    mask_seconds: float = 0.0


@dataclass
class _Active:
    """A request's grammar (compiled from ``key``); the grammar sees the request's output
    tokens from index ``start`` on (after its reasoning) and has accepted ``num_accepted``."""

    request: Request
    grammar: object
    key: GrammarKey
    start: int = 0
    num_accepted: int = 0


class StructuredOutputManager:
    """Grammars of the engine's constrained requests (see the module docstring). ``executor``
    runs the compiles (default: one worker thread, so the engine thread never compiles); a
    backend (its library's import, the tokenizer's vocabulary) is built by its first compile.
    ``num_compiles`` / ``num_cache_hits`` count since the start."""

    def __init__(self, tokenizer, vocab_size: int, executor: Executor | None = None,
                 config: StructuredOutputsConfig | None = None,
                 reasoner: ReasoningParser | None = None) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.config = config or StructuredOutputsConfig()
        self._executor = executor
        #: With a reasoning parser, a request's grammar starts once its reasoning has ended
        #: (vLLM's rule): no mask while it reasons, and the token that ends it is not fed.
        self.reasoner = reasoner
        self._reasoning: set[str] = set()  # ids of constrained requests still reasoning
        self._backends: dict[str, object] = {}
        self._cache: dict[GrammarKey, Future] = {}
        # by request id, with the request itself: an id may come back once its request ended
        self._pending: dict[str, tuple[Request, Future, GrammarKey]] = {}
        self._grammars: dict[str, _Active] = {}
        self._reported: set[GrammarKey] = set()  # compiles whose seconds a step has reported
        self.num_compiles = self.num_cache_hits = 0
        self._step = _StepWork()

    def _backend(self, name: str):
        backend = self._backends.get(name)
        if backend is None:
            if name == "guidance":
                from workbench.structured_output.backend_guidance import GuidanceBackend as cls
            else:
                from workbench.structured_output.backend_xgrammar import XgrammarBackend as cls
            backend = self._backends[name] = cls(self.tokenizer, self.vocab_size)
        return backend

    def _timed_compile(self, key: GrammarKey):
        """(compiled grammar, seconds), on the executor's thread (one at a time by default)."""
        start = time.perf_counter()
        compiled = self._backend(key.backend).compile(key)
        return compiled, time.perf_counter() - start

    def _compile(self, key: GrammarKey) -> tuple[Future, bool]:
        """The compile of ``key``, and whether it was cached (done or under way)."""
        future = self._cache.get(key)
        if future is not None:
            return future, True
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="workbench-grammar")
        future = self._cache[key] = self._executor.submit(self._timed_compile, key)
        return future, False

    def _ready(self, request: Request, key: GrammarKey, future: Future, seconds: float) -> None:
        grammar = self._backends[key.backend].make_grammar(future.result()[0])
        self._grammars[request.request_id] = _Active(request, grammar, key)
        self._step.compiled[request.request_id] = seconds
        self._step.backends[request.request_id] = key.backend

    def _count_compile(self, key: GrammarKey, future: Future) -> None:
        """Count a finished compile once, and report its seconds to this step."""
        if key not in self._reported:
            self._reported.add(key)
            self.num_compiles += 1
            if future.exception() is None:
                self._step.compile_seconds.append(future.result()[1])

    def add_request(self, request: Request) -> bool:
        """Start the grammar of a constrained request (others are left alone): a cached one
        is ready at once. Returns whether the request must wait for its compile (the scheduler
        then holds it in WAITING_FOR_FSM)."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return False
        if self.reasoner is not None and not self.reasoner.is_reasoning_end(
                request.prompt_token_ids):
            self._reasoning.add(request.request_id)
        key = grammar_key(params, self.config)
        future, cached = self._compile(key)
        if cached:
            self.num_cache_hits += 1
            self._step.cache_hits.append(request.request_id)
        if future.done() and future.exception() is None:
            if not cached:  # compiled before we looked: still a compile
                self._count_compile(key, future)
            self._ready(request, key, future, 0.0 if cached else future.result()[1])
            return False
        self._pending[request.request_id] = (request, future, key)
        return True

    def update_waiting(self, requests: Mapping[str, Request]) -> tuple[list[str], dict[str, str]]:
        """Poll the pending compiles of ``requests``' grammars. Returns the ids whose grammar
        is now ready (the scheduler sets them WAITING) and {id: the compiler's message} of
        those whose grammar failed (the scheduler finishes them with an error)."""
        ready, failed = [], {}
        for rid, (request, future, key) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[rid]
            self._count_compile(key, future)
            if requests.get(rid) is not request:
                continue
            if future.exception() is not None:
                failed[rid] = f"structured_outputs: {future.exception()}"
                continue
            self._ready(request, key, future, future.result()[1])
            ready.append(rid)
        return ready, failed

    @property
    def compiling_request_ids(self):
        """The ids of the requests whose grammar is still compiling (a live view)."""
        return self._pending.keys()

    @property
    def compiling(self) -> bool:
        """Whether some request waits for its grammar."""
        return bool(self._pending)

    def wait_for_compile(self, timeout: float) -> None:
        """Block until a pending compile ends or ``timeout`` seconds pass: for an engine with
        nothing else to run, instead of spinning empty steps (no-op with none pending)."""
        if self._pending:
            wait([future for _, future, _ in self._pending.values()], timeout,
                 return_when=FIRST_COMPLETED)

    def grammar_bitmask(self, scheduler_output: SchedulerOutput) -> dict[str, torch.Tensor]:
        """{request id: its packed int32 mask} for the scheduled constrained rows that sample
        this step (empty when there are none): one row [words] for a plain one; for one
        verifying ``k`` drafts, ``k + 1`` rows [k + 1, words], row ``j`` the mask after
        ``drafts[:j]`` (the matcher advances through the drafts, then rolls them back, so it
        ends as it began). The counts of each request's first row go to the step."""
        if not self._grammars:  # the common step: nothing constrained, nothing to do
            return {}
        chunks = [c for c in scheduler_output.scheduled
                  if c.samples and c.request_id in self._grammars
                  and c.request_id not in self._reasoning]
        if not chunks:
            return {}
        import torch  # only a constrained request needs it: an engine without one imports none

        from workbench.worker.sampler import unpack_bitmask

        start = time.perf_counter()
        num_rows = sum(1 + len(c.spec_token_ids) for c in chunks)
        bitmask = torch.full((num_rows, -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        first, row = [], 0
        for c in chunks:
            grammar = self._grammars[c.request_id].grammar
            first.append(row)
            advanced = 0
            for j in range(len(c.spec_token_ids) + 1):
                # A draft past the grammar's end (none after validate_tokens): no mask after it.
                if advanced == j and not grammar.is_terminated():
                    grammar.fill_bitmask(bitmask, row + j)
                    if j < len(c.spec_token_ids) and grammar.accept_token(c.spec_token_ids[j]):
                        advanced += 1
            grammar.rollback(advanced)
            row += 1 + len(c.spec_token_ids)
        allowed = unpack_bitmask(bitmask[first], self.vocab_size)
        counts = allowed.sum(dim=-1).tolist()
        for i, c in enumerate(chunks):
            forced = int(allowed[i].nonzero()[0]) if counts[i] == 1 else None
            self._step.rows[c.request_id] = GrammarRow(counts[i], forced)
        self._step.mask_seconds += time.perf_counter() - start
        out, row = {}, 0
        for c in chunks:
            n = 1 + len(c.spec_token_ids)
            out[c.request_id] = bitmask[row] if n == 1 else bitmask[row:row + n]
            row += n
        return out

    def accept_tokens(self, requests: Iterable[Request]) -> tuple[list[str], dict[str, str]]:
        """Advance each constrained request's grammar on its new tokens (those after the ones
        it accepted: one per step, or a step's accepted drafts). Returns the ids whose grammar
        ended (the caller finishes them "stop") and {id: message} of those with a token the
        grammar refused (the caller finishes them with an error)."""
        ended, refused = [], {}
        if not self._grammars:
            return ended, refused
        start = time.perf_counter()
        for request in requests:
            active = self._active(request.request_id, request)
            if active is None:
                continue
            if request.request_id in self._reasoning:
                # The grammar starts after the token that ends the reasoning (not fed to it).
                new = request.output_token_ids[active.start:]
                active.start = len(request.output_token_ids)
                if self.reasoner.is_reasoning_end_streaming(request.all_token_ids, new):
                    self._reasoning.discard(request.request_id)
                continue
            for token in request.output_token_ids[active.start + active.num_accepted:]:
                if not active.grammar.accept_token(token):
                    refused[request.request_id] = (
                        f"structured_outputs: the grammar does not accept token {token}.")
                    break
                active.num_accepted += 1
                if active.grammar.is_terminated():
                    ended.append(request.request_id)
                    break
        self._step.mask_seconds += time.perf_counter() - start
        return ended, refused

    def _active(self, request_id: str, request: Request | None = None) -> _Active | None:
        active = self._grammars.get(request_id)
        if active is None or (request is not None and active.request is not request):
            return None
        return active

    def validate_tokens(self, request_id: str, tokens: list[int]) -> int:
        """How many leading draft ``tokens`` the request's grammar accepts in turn, its state
        unchanged (speculative decoding: the engine keeps that many of its drafts); a request
        without a grammar accepts them all, one still reasoning none (its grammar starts at a
        token the drafts could cross)."""
        if request_id in self._reasoning:
            return 0
        active = self._active(request_id)
        return len(tokens) if active is None else active.grammar.validate_tokens(list(tokens))

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` tokens the request's grammar accepted (drafts that the
        target model then rejected, removed from the request's output too); no-op without a
        grammar. ValueError when it accepted fewer."""
        active = self._active(request_id)
        if active is None or not num_tokens:
            return
        if not 0 < num_tokens <= active.num_accepted:
            raise ValueError(f"rollback: {request_id!r} accepted {active.num_accepted} tokens, "
                             f"cannot undo {num_tokens}.")
        active.grammar.rollback(num_tokens)
        active.num_accepted -= num_tokens

    def remove(self, request_ids: Iterable[str]) -> None:
        """Forget the grammars of these ids' finished requests (a new request that took a
        finished one's id keeps its own); the compiled grammars stay cached."""
        for rid in request_ids:
            for table in (self._grammars, self._pending):
                entry = table.get(rid)
                if entry is not None and (entry.request if table is self._grammars
                                          else entry[0]).is_finished:
                    del table[rid]
            if rid not in self._grammars and rid not in self._pending:
                self._reasoning.discard(rid)

    def take_step(self, requests: Mapping[str, Request]) -> StructuredOutputStep:
        """This step's work, with the requests still WAITING_FOR_FSM; starts the next. A step
        with no grammar work (none compiling, reasoning or masked) gets the one shared empty
        step, which is immutable."""
        work = self._step
        if not (self._pending or self._reasoning or work.compiled or work.cache_hits
                or work.compile_seconds or work.backends or work.rows or work.mask_seconds):
            return _IDLE_STEP
        self._step = _StepWork()
        return StructuredOutputStep(
            waiting_for_fsm=tuple(rid for rid, (request, *_) in self._pending.items()
                                  if requests.get(rid) is request),
            compiled=FrozenDict(work.compiled), cache_hits=tuple(work.cache_hits),
            compile_seconds=tuple(work.compile_seconds), backends=FrozenDict(work.backends),
            rows=FrozenDict(work.rows), mask_seconds=work.mask_seconds,
            reasoning=tuple(sorted(rid for rid in self._reasoning if rid in requests)))

    def __deepcopy__(self, memo: dict) -> StructuredOutputManager:
        """This manager for a forked engine (``copy.deepcopy`` of the engine: ``memo`` gives the
        requests' copies). Shared, immutable once built: the compile executor, the backends and
        the compiled grammars; its own: the cache's index (a compile one engine starts is no
        cache hit in the other), the counters, the pending compiles (going on for the copies)
        and each grammar's matcher -- a new one over the same compiled grammar, fed the tokens
        the original's had accepted."""
        new = StructuredOutputManager(self.tokenizer, self.vocab_size, self._executor, config=self.config,
                                      reasoner=copy.deepcopy(self.reasoner, memo))
        memo[id(self)] = new
        new._backends, new._cache, new._reported = dict(self._backends), dict(self._cache), set(self._reported)
        new.num_compiles, new.num_cache_hits = self.num_compiles, self.num_cache_hits
        new._reasoning = set(self._reasoning)
        new._pending = {rid: (copy.deepcopy(r, memo), f, key) for rid, (r, f, key) in self._pending.items()}
        for rid, active in self._grammars.items():
            request = copy.deepcopy(active.request, memo)
            grammar = self._backends[active.key.backend].make_grammar(self._cache[active.key].result()[0])
            for token in request.output_token_ids[active.start:active.start + active.num_accepted]:
                grammar.accept_token(token)
            new._grammars[rid] = _Active(request, grammar, active.key, active.start, active.num_accepted)
        new._step = copy.deepcopy(self._step, memo)
        return new

    def __repr__(self) -> str:
        return (f"StructuredOutputManager(backend={self.config.backend}, "
                f"cached={len(self._cache)}, "
                f"compiling={len(self._pending)}, active={len(self._grammars)})")
