"""AsyncLLM: an LLMEngine served to asyncio code, one async stream per request; the engine
runs in this process on an engine thread (the default: notebooks step and inspect it), or
as an engine core in a child process (vLLM V1's ``VLLM_ENABLE_V1_MULTIPROCESSING=1``,
``EngineArgs(multiprocess_mode=True)``: :meth:`AsyncLLM.from_engine_args`).

In process: the engine is not thread-safe, so exactly one thread (the *engine thread*) ever calls into
it. Everything else reaches the engine by submitting a callable that the engine thread runs
between two steps (:meth:`AsyncLLM.call`). Outputs go back to each request's asyncio loop with
``loop.call_soon_threadsafe`` into the request's queue.

Input processing (tokenization, chat templates, decoding for echo) runs on a separate
*input thread*, once per request, so a huge prompt never pauses the running streams: the
engine thread only queues requests processed already
(:class:`~workbench.engine.engine_core_request.EngineCoreRequest`), and never tokenizes or
decodes a prompt.

In a child process (:class:`~workbench.engine.core_client.AsyncMPClient`): requests go to the
core over ZMQ; the client's output thread is the output handler, which hands each step's
outputs to their requests' loops in chunks of ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` (one callback
per loop and chunk, so a huge step never holds a loop for long), into each request's
:class:`~workbench.engine.request_output_collector.RequestOutputCollector`, which merges the
DELTA outputs its consumer has not taken yet, as vLLM's. In process every output is kept
(an :class:`~workbench.engine.request_output_collector.OutputQueue`): one chunk per step.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import functools
import html
import os
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from workbench.engine.core_client import AsyncMPClient, multiprocessing_enabled
from workbench.engine.core_proc import EngineCore
from workbench.engine.engine_core_request import EngineCoreRequest
from workbench.engine.exceptions import EngineDeadError
from workbench.engine.fork import set_engine_thread
from workbench.engine.input_processor import PromptType
from workbench.engine.llm_engine import LLMEngine
from workbench.engine.request_output_collector import OutputQueue, RequestOutputCollector
from workbench.engine.serial_utils import loads
from workbench.lora.request import LoRARequest
from workbench.metrics.stats import StatLoggerBase
from workbench.outputs import RequestOutput
from workbench.sampling_params import SamplingParams

if TYPE_CHECKING:
    from workbench.config import EngineArgs

T = TypeVar("T")
_INPUT_NICENESS = 10  # the input thread's nice value: below the engine thread's priority
__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream"]


def output_chunk_size() -> int:
    """vLLM's ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` (default 128): outputs handed to an event
    loop per callback."""
    value = os.environ.get("VLLM_V1_OUTPUT_PROC_CHUNK_SIZE", "128")
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"VLLM_V1_OUTPUT_PROC_CHUNK_SIZE must be an integer >= 1, got {value!r}.")
    return size


def _lower_priority() -> None:
    """Make the calling thread yield the CPU to the engine thread (Linux: per-thread nice).

    Tokenizing a huge prompt takes a core for seconds; on a small CPU box the engine's
    intra-op threads would otherwise wait for it and every running stream would stutter.
    """
    if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _INPUT_NICENESS)
        except OSError:  # not permitted here: run at normal priority
            pass


class RequestStream:
    """Async iterator over one request's RequestOutputs, ending after the finished one; what
    each carries is its params' ``output_kind`` (CUMULATIVE, DELTA, or FINAL_ONLY: one).

    ``finished`` turns True with the request's final output; ``close()`` before that aborts
    the request (so does cancelling a pending ``__anext__``) and ends the iteration.
    """

    def __init__(self, owner: AsyncLLM, request_id: str,
                 collector: RequestOutputCollector | OutputQueue) -> None:
        self.request_id = request_id
        self.finished = False
        self.closed = False
        self.aborted = False  # close() aborted the request before it finished
        self._owner = owner
        self._collector = collector

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        try:
            item = await self._collector.get()
        except Exception:  # delivered by the engine, which already dropped the request
            self.closed = True
            raise
        except BaseException:  # cancelled while waiting: the consumer is gone
            self.close()
            raise
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not (self.finished or self.closed):
            self.aborted = True
            self._owner.abort(self.request_id)
        self.closed = True

    async def aclose(self) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "finished" if self.finished else "aborted" if self.aborted else \
            "closed" if self.closed else "open"
        return f"RequestStream(request_id={self.request_id!r}, {state})"

    def _repr_html_(self) -> str:
        return f"<b>RequestStream</b> <code>{html.escape(repr(self))}</code>"


def _put_all(items: list[tuple[RequestOutputCollector, Any]]) -> None:
    """On a consumer's loop: one chunk of outputs (or errors) into their collectors."""
    for collector, item in items:
        collector.put(item)


def _stop_at_exit(ref: weakref.ref) -> None:
    llm = ref()
    if llm is not None and llm._client is not None:
        llm._client.shutdown()
    elif llm is not None and llm._thread.is_alive():
        llm._request_stop()
        llm._thread.join(timeout=5)


class AsyncLLM:
    """Serve an :class:`LLMEngine` to asyncio code.

    Invariants: only the engine thread touches ``engine`` (and ``_streams``); other threads
    use what was captured here at construction: ``model_config`` (immutable facts) and
    ``input_processor``, whose limits never change and whose tokenizing, rendering and
    decoding run on the input thread only. The engine thread sleeps on a condition while
    there is neither work nor a pending call (waking every few ms for a while to keep a CPU's
    worker threads awake: ``engine.idle``); a request whose consumer stops iterating is
    aborted, so it frees its KV blocks.
    """

    def __init__(self, engine: LLMEngine | None = None, *, client: AsyncMPClient | None = None
                 ) -> None:
        """Serve ``engine`` from an engine thread, or (``client``, and no engine) the engine
        core that ``client`` runs in a child process (see :meth:`from_engine_args`)."""
        if (engine is None) == (client is None):
            raise ValueError("AsyncLLM needs an engine (in process) or a client (an engine core "
                             "in a child process), not both.")
        #: The LLMEngine, in process; None when the engine core runs in a child process.
        self.engine = engine
        self._client = client
        facts = engine if engine is not None else client
        #: The model's facts (max_model_len, vocab_size, path): read them from any thread.
        self.model_config = facts.model_config
        #: The engine's configuration (its own copy, never changed): read it from any thread.
        self.config = facts.config
        #: The engine's input processor, from now on used by the input thread (the engine
        #: thread gets processed requests); its tokenizer is shared with the detokenizer.
        self.input_processor = facts.input_processor
        #: The engine's clock (``LLMEngine.clock``): the server stamps a request's arrival
        #: with it before rendering, as vLLM stamps ``arrival_time`` (callable from any thread).
        #: A core process's is ``time.monotonic``, the same clock in every process.
        self.clock = engine.clock if engine is not None else time.monotonic
        self._scheduler_stats = facts.scheduler_stats  # the latest, published by the engine
        #: Stat loggers fed the core process's stats (in process, they are the engine's own).
        self.stat_loggers: dict[str, StatLoggerBase] = {}
        # One input thread: the tokenizer is used by it and the engine thread, no more.
        self._inputs = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="workbench-inputs", initializer=_lower_priority
        )
        self._cond = threading.Condition()
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._stopping = False
        self._error: BaseException | None = None
        # request id -> (its consumer's loop, its collector); the engine thread's only, or,
        # with a core process, shared by the event loops and the output thread (_lock).
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop,
                                       RequestOutputCollector | OutputQueue]] = {}
        self._lock = threading.Lock()
        self._chunk_size = output_chunk_size()
        #: Set when the engine has stopped (shutdown, or an error: see dead_error).
        self.stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="workbench-engine", daemon=True)
        if engine is not None:
            self._core = EngineCore(engine)
            set_engine_thread(engine, self._thread)  # forking it from elsewhere is refused
            self._thread.start()
        else:
            client.set_handlers(self._handle_core_outputs, self._handle_core_dead)
        # A program that exits without shutdown() stops the engine thread first: a daemon
        # thread still calling into torch while the interpreter tears down can abort the
        # process ("terminate called without an active exception").
        atexit.register(_stop_at_exit, weakref.ref(self))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        """vLLM's constructor: the engine core in a child process when
        ``engine_args.multiprocess_mode`` or ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` says so,
        otherwise an LLMEngine in this process."""
        config = engine_args.create_engine_config()
        if multiprocessing_enabled(config.multiprocess_mode):
            return cls(client=AsyncMPClient(config))
        return cls(LLMEngine(config))

    # ------------------------------------------------------------------ public API
    @property
    def multiprocess_mode(self) -> bool:
        """Whether the engine core runs in a child process."""
        return self._client is not None

    @property
    def is_running(self) -> bool:
        """True while the engine serves requests."""
        if self._client is not None:
            return self._client.is_alive
        return self._thread.is_alive() and self._error is None and not self._stopping

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine stopped (None while it runs, and after a shutdown)."""
        if self._client is not None:
            return None if self._client.stopping else self._client.dead_error
        return self._error

    @property
    def scheduler_stats(self):
        """The latest step's SchedulerStats (in process, or shipped by the core process)."""
        return self._scheduler_stats

    async def check_health(self) -> None:
        """vLLM's ``check_health``: raises EngineDeadError once the engine has stopped."""
        if not self.is_running:
            raise EngineDeadError(self._dead_message())

    async def get_vllm_config(self):
        """The engine's EngineConfig (vLLM's VllmConfig); ``get_*_config`` are vLLM's
        EngineClient accessors, answered in this process in both modes."""
        return self.config

    async def get_model_config(self):
        return self.model_config

    async def get_tokenizer(self):
        return self.input_processor.tokenizer

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        """vLLM's ``collective_rpc`` over the one worker (the runner): ``[method(*args, **kwargs)]``
        (see :mod:`workbench.worker.run_method`)."""
        return await self.call_utility("collective_rpc", method, timeout, args, kwargs)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the engine thread between two steps; return or raise its result."""
        return await asyncio.wrap_future(self.submit(fn))

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        """Queue ``fn()`` for the engine thread (between two steps); its future. Safe from
        any thread; a dead engine fails the future with EngineDeadError. In process only:
        a core process runs no callables (:meth:`call_utility` names a method instead)."""
        if self._client is not None:
            raise RuntimeError("AsyncLLM.submit/call run a callable on the in-process engine "
                               "thread; this engine core runs in a child process: use "
                               "call_utility(method, *args).")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping or self._error is not None:
                future.set_exception(EngineDeadError(self._dead_message()))
                return future
            self._calls.append((fn, future))
            self._cond.notify_all()
        return future

    async def run_input(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the input thread (tokenizer work off the engine)."""
        if not self.is_running:
            raise EngineDeadError(self._dead_message())
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._inputs, functools.partial(fn, *args, **kwargs))

    async def process_inputs(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, *,
        priority: int = 0, tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None, lora_request: LoRARequest | None = None,
        arrival_time: float | None = None,
        serving: bool = False,
    ) -> EngineCoreRequest:
        """``InputProcessor.process_inputs`` on the input thread (raises its ValueError or
        TypeError); ``arrival_time`` in :attr:`clock` seconds (None: when the engine queues
        it); ``serving``: the OpenAI server's prompt-length rule and wording."""
        return await self.run_input(
            self.input_processor.process_inputs, request_id, prompt, params,
            priority=priority, tokenization_kwargs=tokenization_kwargs, trace_headers=trace_headers,
            lora_request=lora_request, arrival_time=arrival_time, serving=serving,
        )

    async def call_utility(self, method: str, *args: Any) -> Any:
        """``EngineCore.<method>(*args)`` between two steps, in process or in the core process
        (vLLM's utility call): e.g. ``"get_history"`` (the StepHistory), ``"add_lora"``."""
        if self._client is not None:
            return await self._client.call_utility_async(method, *args)
        return await self.call(lambda: self._core.call_utility(method, args))

    def call_utility_sync(self, method: str, *args: Any) -> Any:
        """:meth:`call_utility` from a thread with no event loop (server start-up)."""
        if self._client is not None:
            return self._client.call_utility(method, *args)
        return self.submit(lambda: self._core.call_utility(method, args)).result()

    async def get_history(self):
        """The engine's StepHistory (a copy shipped over, with a core process)."""
        return await self.call_utility("get_history")

    async def sleep(self, level: int = 1) -> None:
        """``LLMEngine.sleep(level)`` on the engine, between two steps."""
        await self.call_utility("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.call_utility("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return await self.call_utility("is_sleeping")

    async def start_profile(self) -> None:
        """``LLMEngine.start_profile()`` on the engine, between two steps."""
        await self.call_utility("start_profile")

    async def stop_profile(self):
        """``LLMEngine.stop_profile()`` on the engine; the trace's path."""
        return await self.call_utility("stop_profile")

    def is_tracing_enabled(self) -> bool:
        """Whether the engine sends request spans (``otlp_traces_endpoint``; vLLM's name), read
        from the config, off the engine thread."""
        return bool(self.config.otlp_traces_endpoint)

    async def render_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """``InputProcessor.render_chat`` on the input thread (raises its ValueError)."""
        return await self.run_input(self.input_processor.render_chat, messages, **kwargs)

    async def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The tokenizer's token ids of ``text``, on the input thread."""
        return await self.run_input(self.input_processor.tokenizer.encode, text,
                                    add_special_tokens=add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        """The tokenizer's text of ``token_ids`` (special tokens kept), on the input thread."""
        return await self.run_input(self.input_processor.tokenizer.decode, token_ids)

    async def add_request(
        self, prompt: PromptType | EngineCoreRequest, params: SamplingParams | None,
        request_id: str, *, priority: int = 0, lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Process and queue a request; return the stream of its RequestOutputs, each as its
        params' ``output_kind`` says (vLLM's default CUMULATIVE: the text so far).

        A prompt is processed once, on the input thread; an EngineCoreRequest (processed
        already: ``params`` and ``priority`` unused) is queued as it is. A ValueError (or
        TypeError: ``params`` must be a SamplingParams, as vLLM) from validation propagates
        unchanged and nothing is queued (requests already in flight are untouched).

        A ``request_id`` already in flight does not refuse the request: it runs as
        ``f"{request_id}-{8 hex}"`` (the stream's ``request_id``, which its abort names),
        and the request in flight is untouched.
        """
        if isinstance(prompt, EngineCoreRequest):
            request = prompt
        else:
            request = await self.process_inputs(request_id, prompt, params, priority=priority,
                                                lora_request=lora_request)
        loop = asyncio.get_running_loop()
        collector = OutputQueue() if self._client is None else \
            RequestOutputCollector(request.sampling_params.output_kind, request_id)

        # vLLM V1 serves two requests in flight under one id: AsyncLLM.add_request ->
        # InputProcessor.assign_request_id keeps the caller's id as external_req_id and runs
        # the request as f"{external_req_id}-{random_uuid():.8}" (vllm/v1/engine/async_llm.py).
        # Here only a request whose id is already in flight gets that suffix: a lone request
        # keeps its id, so StepRecords, request tables and notebooks (nbval compares their
        # stored outputs) stay readable and deterministic. LLMEngine keeps ids verbatim.
        alias = f"{request_id}-{uuid.uuid4().hex[:8]}"
        if self._client is not None:
            return await self._add_to_core(request, request_id, alias, loop, collector)
        chosen: list[str] = []  # the id add() ran the request under (engine thread)

        def add() -> str:
            rid, queued = request_id, request
            if rid in self._streams or rid in self.engine.output_processor.parents:
                rid = alias
                queued = dataclasses.replace(request, request_id=rid)
            self.engine.add_request(rid, queued)
            self._streams[rid] = (loop, collector)
            chosen.append(rid)
            return rid

        try:
            rid = await self.call(add)
        except asyncio.CancelledError:  # the caller left while the engine thread added it
            # runs after add() on the engine thread (calls run in order): abort its own id,
            # never a request in flight under the same one
            if self.is_running:
                self.submit(lambda: chosen and self.engine.abort_request(chosen[0]))
            raise
        return RequestStream(self, rid, collector)

    async def _add_to_core(self, request: EngineCoreRequest, request_id: str, alias: str,
                           loop: asyncio.AbstractEventLoop,
                           collector: RequestOutputCollector) -> RequestStream:
        """add_request with a core process: the stream is registered before the ADD is sent
        (outputs may follow at once); a refusal unregisters it and raises."""
        self._client.ensure_alive()
        with self._lock:
            rid = alias if request_id in self._streams else request_id
            self._streams[rid] = (loop, collector)
        queued = request if rid == request.request_id else dataclasses.replace(request,
                                                                                request_id=rid)
        try:
            await self._client.add_request_async(queued)
        except asyncio.CancelledError:  # the caller left: the core may have queued it
            self._client.abort_requests([rid])
            self._drop_stream(rid)
            raise
        except BaseException:
            self._drop_stream(rid)
            raise
        return RequestStream(self, rid, collector)

    def _drop_stream(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    async def generate(
        self, prompt: PromptType | EngineCoreRequest, params: SamplingParams, request_id: str,
        *, lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a request's RequestOutputs until the finished one (vLLM's shape), each as
        ``params.output_kind`` says: CUMULATIVE by default (as vLLM), DELTA for new text only.

        Validation errors are raised at the first iteration; leaving the iteration early
        (break + close, cancellation, an exception) aborts the request.
        """
        stream = await self.add_request(prompt, params, request_id, lora_request=lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when unknown or finished); its blocks are freed on the
        engine thread before its next step, and its stream ends with a final output whose
        finish_reason is "abort" (vLLM V1's AsyncLLM). Safe from any thread, does not wait."""
        if self._client is not None:  # the core sends the final "abort" output
            if self._client.is_alive:
                self._client.abort_requests([request_id])
            return

        def do_abort() -> None:
            # vLLM V1's AsyncLLM: the stream gets a final "abort" output at once (the output
            # processor puts it on the request's queue); LLMEngine.step() never returns one.
            engine = self.engine
            self._deliver(engine._abort(request_id))
            if not engine.has_unfinished_requests() and engine.has_unrecorded_aborts():
                engine.step()  # nothing else to run: record the abort now (history, /metrics)
                self._scheduler_stats = engine.scheduler_stats

        if self.is_running:
            self.submit(do_abort)

    async def shutdown(self) -> None:
        """Stop the engine (thread or core process) and wait for it: requests in flight are
        aborted (their blocks freed) and their streams raise EngineDeadError."""
        if self._client is not None:
            await asyncio.to_thread(self._client.shutdown)
            self._inputs.shutdown(wait=False, cancel_futures=True)
            return
        self._request_stop()
        await asyncio.to_thread(self._thread.join)
        self._inputs.shutdown(wait=False, cancel_futures=True)

    def _request_stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ engine thread
    def _dead_message(self) -> str:
        if self._client is not None and self._client.dead_error is not None:
            return str(self._client.dead_error)
        if self._error is not None:
            return f"The engine stopped after an error: {self._error!r}"
        return "The engine is shut down."

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._calls or self._stopping or engine.has_unfinished_requests()):
                        if not self._cond.wait(engine.idle.timeout()):  # a tick: keep threads awake
                            engine.idle.poke()
                    calls, self._calls = self._calls, []
                    stopping = self._stopping
                for fn, future in calls:
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(fn())
                        except BaseException as exc:  # handed to the caller
                            future.set_exception(exc)
                if stopping:
                    if self._streams:  # leave the engine clean: in-flight requests aborted
                        engine.abort_request(list(self._streams))
                        engine.step()
                    break
                # An abort that left nothing to run is still recorded by one more step (the
                # history, the request tracker and /metrics' "abort" count see it).
                if (engine.has_unfinished_requests() or engine.has_unrecorded_aborts()
                        or engine.scheduler.has_kv_transfers()):  # a producer frees read blocks
                    self._deliver(engine.step())
                    self._scheduler_stats = engine.scheduler_stats
        except BaseException as exc:
            self._error = exc
        finally:
            with self._cond:
                self._stopping = True
                pending, self._calls = self._calls, []
            dead = EngineDeadError(self._dead_message())
            for _, future in pending:
                if future.set_running_or_notify_cancel():
                    future.set_exception(dead)
            for loop, collector in self._streams.values():
                self._put(loop, collector.put, dead)
            self._streams.clear()
            set_engine_thread(engine, None)
            self.stopped.set()

    # ------------------------------------------------------------------ core process: output handler
    def _handle_core_outputs(self, message) -> None:
        """On the client's output thread: feed the stat loggers the core's stats, then hand
        the outputs to their requests' loops, a chunk at a time (one callback per loop)."""
        if message.stats is not None:
            scheduler_stats, iteration_stats = loads(message.stats)
            self._scheduler_stats = scheduler_stats
            for stat_logger in list(self.stat_loggers.values()):
                stat_logger.record(scheduler_stats, iteration_stats)
        outputs = message.outputs
        for start in range(0, len(outputs), self._chunk_size):
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            with self._lock:
                for out in outputs[start:start + self._chunk_size]:
                    target = (self._streams.pop(out.request_id, None) if out.finished
                              else self._streams.get(out.request_id))
                    if target is not None:
                        by_loop.setdefault(target[0], []).append((target[1], out))
            for loop, items in by_loop.items():
                self._put(loop, _put_all, items)

    def _handle_core_dead(self, error: EngineDeadError) -> None:
        """On the client's output thread, once: every open stream gets ``error``."""
        with self._lock:
            streams, self._streams = self._streams, {}
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, collector in streams.values():
            by_loop.setdefault(loop, []).append((collector, error))
        for loop, items in by_loop.items():
            self._put(loop, _put_all, items)
        self.stopped.set()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            streams = self._streams
            target = streams.pop(out.request_id, None) if out.finished else streams.get(out.request_id)
            if target is not None:
                loop, collector = target
                self._put(loop, collector.put, out)

    @staticmethod
    def _put(loop: asyncio.AbstractEventLoop, fn: Callable[[Any], None], item: Any) -> None:
        try:
            loop.call_soon_threadsafe(fn, item)
        except RuntimeError:  # that consumer's loop is closed: nobody is listening
            pass

    def __repr__(self) -> str:
        s = self._scheduler_stats
        return (
            f"AsyncLLM(running={s.num_running_reqs}, waiting={s.num_waiting_reqs}, "
            f"kv_usage={s.kv_cache_usage:.2f}, alive={self.is_running}"
            + (", multiprocess_mode=True)" if self._client is not None else ")")
        )

    def _repr_html_(self) -> str:
        from workbench.utils.reprs import html_table

        s = self._scheduler_stats
        error = self.dead_error
        return html_table("AsyncLLM", {
            "engine core process" if self._client is not None else "engine thread":
            "running" if self.is_running
            else f"stopped: {error!r}" if error else "shut down",
            "running / waiting": f"{s.num_running_reqs} / {s.num_waiting_reqs}",
            "KV cache used": f"{s.kv_cache_usage:.0%}",
        })
