"""StructuredOutputManager (vLLM's name): owned by the engine; compiles each constrained
request's grammar on its own thread, and per step fills the token bitmask of the constrained
rows that sample and advances their grammars on the tokens they got.

A constrained request enters WAITING_FOR_FSM unless its grammar is already compiled (the
cache is keyed by :func:`~workbench.structured_output.backend_xgrammar.grammar_key`);
``update_waiting`` (before each schedule) sets it WAITING once its compile is done, or reports
it failed. What it did in a step -- who waits, who still reasons (with a reasoning parser,
a grammar starts once its request's reasoning ends), compile times, each row's allowed-token count
and forced token -- is :class:`StructuredOutputStep`, kept on the StepRecord.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from workbench.core.sched.output import SchedulerOutput
from workbench.reasoning import ReasoningParser
from workbench.request import Request, RequestStatus
from workbench.structured_output.backend_xgrammar import (
    GrammarKey,
    XgrammarBackend,
    XgrammarGrammar,
    grammar_key,
)
from workbench.worker.sampler import unpack_bitmask


@dataclass(frozen=True)
class GrammarRow:
    """One constrained row of a step: how many tokens the mask allowed, and the token the
    grammar forced (the only one allowed), if any."""

    num_allowed: int
    forced_token: int | None


@dataclass
class StructuredOutputStep:
    """A step's structured-output work: requests still WAITING_FOR_FSM after it, the
    compile seconds of grammars that became ready (0.0: from the cache), and the rows."""

    waiting_for_fsm: tuple[str, ...] = ()
    compiled: dict[str, float] = field(default_factory=dict)
    rows: dict[str, GrammarRow] = field(default_factory=dict)
    #: Constrained requests still reasoning after the step (their grammar not started yet).
    reasoning: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.waiting_for_fsm or self.compiled or self.rows or self.reasoning)


class StructuredOutputManager:
    """Grammars of the engine's constrained requests (see the module docstring). ``executor``
    runs the compiles (default: one worker thread, so the engine thread never compiles); the
    backend (xgrammar's import, the tokenizer's vocabulary) is built by the first compile."""

    def __init__(self, tokenizer, vocab_size: int, executor: Executor | None = None,
                 reasoner: ReasoningParser | None = None) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._executor = executor
        #: With a reasoning parser, a request's grammar starts once its reasoning has ended
        #: (vLLM's rule): no mask while it reasons, and the token that ends it is not fed.
        self.reasoner = reasoner
        self._reasoning: set[str] = set()  # ids of constrained requests still reasoning
        self._backend: XgrammarBackend | None = None
        self._cache: dict[GrammarKey, Future] = {}
        # by request id, with the request itself: an id may come back once its request ended
        self._pending: dict[str, tuple[Request, Future]] = {}
        self._grammars: dict[str, tuple[Request, XgrammarGrammar]] = {}
        self._step = StructuredOutputStep()

    def _timed_compile(self, key: GrammarKey):
        """(compiled grammar, seconds), on the executor's thread (one at a time by default)."""
        start = time.perf_counter()
        if self._backend is None:
            self._backend = XgrammarBackend(self.tokenizer, self.vocab_size)
        compiled = self._backend.compile(key)
        return compiled, time.perf_counter() - start

    def _compile(self, key: GrammarKey) -> Future:
        future = self._cache.get(key)
        if future is None:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="workbench-grammar")
            future = self._executor.submit(self._timed_compile, key)
            self._cache[key] = future
        return future

    def add_request(self, request: Request) -> None:
        """Start the grammar of a constrained request (others are left alone): a cached one
        is ready at once; else the request goes WAITING_FOR_FSM while it compiles."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        if self.reasoner is not None and not self.reasoner.is_reasoning_end(
                request.prompt_token_ids):
            self._reasoning.add(request.request_id)
        future = self._compile(grammar_key(params))
        if future.done() and future.exception() is None:
            self._grammars[request.request_id] = (request, XgrammarGrammar(future.result()[0]))
            self._step.compiled[request.request_id] = 0.0
        else:
            request.status = RequestStatus.WAITING_FOR_FSM
            self._pending[request.request_id] = (request, future)

    def update_waiting(self, requests: Mapping[str, Request]) -> dict[str, str]:
        """Set WAITING the requests whose grammar compiled; returns {id: the compiler's
        message} of those whose grammar failed (the caller finishes them with an error)."""
        failed = {}
        for rid, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[rid]
            if requests.get(rid) is not request:
                continue
            if future.exception() is not None:
                failed[rid] = f"structured_outputs: {future.exception()}"
                continue
            compiled, seconds = future.result()
            self._grammars[rid] = (request, XgrammarGrammar(compiled))
            self._step.compiled[rid] = seconds
            if request.status is RequestStatus.WAITING_FOR_FSM:
                request.status = RequestStatus.WAITING
        return failed

    @property
    def compiling(self) -> bool:
        """Whether some request waits for its grammar."""
        return bool(self._pending)

    def wait_for_compile(self, timeout: float) -> None:
        """Block until a pending compile ends or ``timeout`` seconds pass: for an engine with
        nothing else to run, instead of spinning empty steps (no-op with none pending)."""
        if self._pending:
            wait([future for _, future in self._pending.values()], timeout,
                 return_when=FIRST_COMPLETED)

    def grammar_bitmask(self, scheduler_output: SchedulerOutput) -> dict[str, torch.Tensor]:
        """{request id: its packed int32 mask row} for the scheduled constrained rows that
        sample this step (empty when there are none); each row's counts go to the step."""
        if not self._grammars:  # the common step: nothing constrained, nothing to do
            return {}
        ids = [c.request_id for c in scheduler_output.scheduled
               if c.samples and c.request_id in self._grammars
               and c.request_id not in self._reasoning]
        if not ids:
            return {}
        bitmask = torch.full((len(ids), -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        for row, rid in enumerate(ids):
            self._grammars[rid][1].fill_bitmask(bitmask, row)
        allowed = unpack_bitmask(bitmask, self.vocab_size)
        counts = allowed.sum(dim=-1).tolist()
        for row, rid in enumerate(ids):
            forced = int(allowed[row].nonzero()[0]) if counts[row] == 1 else None
            self._step.rows[rid] = GrammarRow(counts[row], forced)
        return {rid: bitmask[row] for row, rid in enumerate(ids)}

    def accept_tokens(self, requests: Iterable[Request]) -> tuple[list[str], dict[str, str]]:
        """Advance each constrained request's grammar on its new token. Returns the ids whose
        grammar ended (the caller finishes them "stop") and {id: message} of those whose token
        the grammar refused (the caller finishes them with an error)."""
        ended, refused = [], {}
        if not self._grammars:
            return ended, refused
        for request in requests:
            request_and_grammar = self._grammars.get(request.request_id)
            if request_and_grammar is None or request_and_grammar[0] is not request:
                continue
            grammar = request_and_grammar[1]
            token = request.output_token_ids[-1]
            if request.request_id in self._reasoning:
                if self.reasoner.is_reasoning_end_streaming(request.all_token_ids, [token]):
                    self._reasoning.discard(request.request_id)
                continue
            if not grammar.accept_token(token):
                refused[request.request_id] = (
                    f"structured_outputs: the grammar does not accept token {token}.")
            elif grammar.is_terminated():
                ended.append(request.request_id)
        return ended, refused

    def remove(self, request_ids: Iterable[str]) -> None:
        """Forget the grammars of these ids' finished requests (a new request that took a
        finished one's id keeps its own); the compiled grammars stay cached."""
        for rid in request_ids:
            for table in (self._grammars, self._pending):
                if rid in table and table[rid][0].is_finished:
                    del table[rid]
            if rid not in self._grammars and rid not in self._pending:
                self._reasoning.discard(rid)

    def take_step(self, requests: Mapping[str, Request]) -> StructuredOutputStep:
        """This step's work, with the requests still WAITING_FOR_FSM; starts the next."""
        step, self._step = self._step, StructuredOutputStep()
        step.waiting_for_fsm = tuple(rid for rid, (request, _) in self._pending.items()
                                     if requests.get(rid) is request)
        step.reasoning = tuple(sorted(rid for rid in self._reasoning if rid in requests))
        return step

    def fork(self, fork_requests: Mapping[int, Request]) -> StructuredOutputManager:
        """This manager for a forked engine, whose request copies ``fork_requests`` gives by
        ``id()`` of the original: the compile executor, backend and cache are shared (a compiled
        grammar is immutable), pending compiles go on for the copies, and each active grammar
        is a new matcher that accepted its copy's output tokens (a request the fork does not
        hold, finished already, is left out)."""
        new = StructuredOutputManager(self.tokenizer, self.vocab_size, self._executor)
        new._backend, new._cache = self._backend, self._cache
        new._pending = {rid: (fork_requests[id(r)], f) for rid, (r, f) in self._pending.items()
                        if id(r) in fork_requests}
        new._grammars = {rid: (fork_requests[id(r)], g.replayed(r.output_token_ids))
                         for rid, (r, g) in self._grammars.items() if id(r) in fork_requests}
        new._step = StructuredOutputStep(self._step.waiting_for_fsm, dict(self._step.compiled),
                                         dict(self._step.rows))
        return new

    def __repr__(self) -> str:
        return (f"StructuredOutputManager(backend=xgrammar, cached={len(self._cache)}, "
                f"compiling={len(self._pending)}, active={len(self._grammars)})")
