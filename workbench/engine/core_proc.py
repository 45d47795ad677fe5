"""The engine core: :class:`EngineCore` (an LLMEngine behind the calls a client makes) and
:class:`EngineCoreProc`, the same core in its own process, served over ZMQ as vLLM V1 runs it.

``EngineCoreProc`` has three threads. The *input thread* receives and decodes the client's
messages onto the input queue; the *busy loop* (the main thread) takes them between steps
and steps the engine while it has work, putting each step's outputs on the output queue;
the *output thread* encodes and sends them. The model never waits for a socket, and the
sockets never wait for the model.

Here the core steps the whole :class:`~workbench.engine.llm_engine.LLMEngine` (scheduler,
runner and output processor: detokenizing and stop strings included, since the scheduler
finishes a request on a stop string in the same step) and ships ``RequestOutput``s; vLLM
ships token ids and detokenizes in the client process.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import traceback
from typing import Any

import zmq

from workbench.engine.engine_core_request import EngineCoreRequest
from workbench.engine.history import StepHistory
from workbench.engine.llm_engine import LLMEngine
from workbench.engine.serial_utils import (EngineCoreOutputs, EngineCoreRequestType,
                                           MsgpackDecoder, MsgpackEncoder, UtilityOutput, dumps,
                                           loads)
from workbench.lora.request import LoRARequest
from workbench.metrics.stats import IterationStats, SchedulerStats, StatLoggerBase
from workbench.outputs import RequestOutput
from workbench.utils.heap import freeze_startup_heap

logger = logging.getLogger(__name__)
_POLL_MS = 500  # the input thread checks this often that its parent process is alive
_STATS_LOGGER = "core_client"  # the stat logger that ships each step's stats to the client
#: vLLM's variable: CPUs a CPU engine core leaves to the front end's process (default 1).
RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def reserve_cpus_for_the_frontend(config) -> int:
    """On a CPU device, unless ``OMP_NUM_THREADS`` sets it: run the core's intra-op threads on
    all CPUs but ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (default 1, at least one thread left), as
    vLLM's CPU worker leaves CPUs to its API server. Without it the front end (HTTP, SSE,
    tokenizing) preempts an OpenMP thread mid-step, and every parallel region then waits for
    it: on a small box each step takes many times longer. Returns the threads used."""
    import torch

    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cpu") and "OMP_NUM_THREADS" not in os.environ:
        reserved = int(os.environ.get(RESERVED_CPU_ENV, "1"))
        torch.set_num_threads(max(1, torch.get_num_threads() - reserved))
    return torch.get_num_threads()


class EngineCore:
    """An LLMEngine behind the operations a client asks of its core: add, abort, step, and the
    utility methods (every public method below; a client calls them by name).

    Invariant: one thread calls it (the in-process engine thread, or the busy loop)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a processed request (ValueError, nothing queued, when the engine refuses it)."""
        self.engine.add_request(request.request_id, request)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort them; their final outputs (finish_reason "abort"), which no step returns."""
        return self.engine._abort(request_ids)

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def has_work(self) -> bool:
        """Whether a step is due: unfinished requests, or aborts not recorded yet."""
        return self.engine.has_unfinished_requests() or self.engine.has_unrecorded_aborts()

    # ------------------------------------------------------------------ utility methods
    def get_history(self) -> StepHistory:
        """The engine's StepHistory (every StepRecord kept): the views work on it."""
        return self.engine.history

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def get_num_free_blocks(self) -> int:
        return self.engine.kv_cache.num_free_blocks

    def check_request_fits(self, request_id: str, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """ValueError (the limit named) unless such a request could ever be served here
        (``Scheduler.check_fits``): the server asks before a beam search's first step."""
        self.engine.scheduler.check_fits(request_id, num_prompt_tokens, max_tokens)

    def get_scheduler_stats(self) -> SchedulerStats:
        return self.engine.scheduler_stats

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        return self.engine.pin_lora(lora_id)

    def sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def start_profile(self) -> None:
        self.engine.start_profile()

    def stop_profile(self):
        return self.engine.stop_profile()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def collective_rpc(self, method, timeout=None, args: tuple = (), kwargs=None) -> list:
        return self.engine.collective_rpc(method, timeout, args, kwargs)

    def call_utility(self, method: str, args: tuple) -> Any:
        """``method(*args)``: one of the public methods above, by name (AttributeError else)."""
        if method.startswith("_") or method in ("engine", "call_utility") \
                or not callable(getattr(self, method, None)):
            raise AttributeError(f"EngineCore has no utility method {method!r}.")
        return getattr(self, method)(*args)


class _StatsForwarder(StatLoggerBase):
    """Keeps the latest step's stats for the output thread (the client's loggers record them)."""

    def __init__(self) -> None:
        self.latest: tuple[SchedulerStats, IterationStats] | None = None

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.latest = (scheduler_stats, iteration_stats)


class EngineCoreProc(EngineCore):
    """The core in a child process: input thread -> busy loop -> output thread (see the module).

    Protocol: the first message sent is the handshake (``ready``: the client-side facts,
    pickled), or ``engine_dead`` when building the engine failed. Each ADD is answered (a
    UtilityOutput of its call id: nothing, or the ValueError that refused it); each step's
    outputs follow in step order; an ``engine_dead`` message is the last one ever sent.
    """

    def __init__(self, engine: LLMEngine, input_address: str, output_address: str,
                 parent_pid: int | None = None) -> None:
        super().__init__(engine)
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.parent_pid = parent_pid
        self._stats: _StatsForwarder | None = None
        if engine.config.log_stats:
            self._stats = _StatsForwarder()
            engine.add_logger(_STATS_LOGGER, self._stats)
        self._ctx = zmq.Context()
        self._done = threading.Event()  # run() ended: the input thread stops too
        self._input_thread = threading.Thread(
            target=self._process_input_socket, args=(input_address,),
            name="workbench-core-input", daemon=True)
        self._output_thread = threading.Thread(
            target=self._process_output_socket, args=(output_address,),
            name="workbench-core-output", daemon=True)

    @staticmethod
    def run_engine_core(config, input_address: str, output_address: str, parent_pid: int) -> None:
        """The child process's entry point: build the engine, say ready, run the busy loop;
        on any failure send ``engine_dead`` (the error) and exit with status 1."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
        try:
            reserve_cpus_for_the_frontend(config)
            core = EngineCoreProc(LLMEngine(config), input_address, output_address, parent_pid)
            freeze_startup_heap()
        except BaseException as exc:
            _send_dead(output_address, f"The engine core failed to start: {exc!r}\n"
                                       f"{traceback.format_exc()}")
            raise SystemExit(1) from None
        raise SystemExit(core.run())

    def run(self) -> int:
        """Say ready, serve until SHUTDOWN (0) or an error (1, after ``engine_dead``)."""
        engine = self.engine
        self._output_thread.start()
        self.output_queue.put(EngineCoreOutputs(ready=dumps({
            "model_config": engine.model_config, "config": engine.config,
            "input_processor": engine.input_processor,
            "scheduler_stats": engine.scheduler_stats, "pid": os.getpid()})))
        self._input_thread.start()
        status = 0
        try:
            self.run_busy_loop()
        except BaseException as exc:
            logger.exception("The engine core stopped after an error.")
            self.output_queue.put(EngineCoreOutputs(engine_dead=f"The engine core stopped after "
                                                                f"an error: {exc!r}"))
            status = 1
        self.output_queue.put(None)  # the output thread sends what is queued, then ends
        self._output_thread.join(timeout=10)
        self._done.set()
        self._input_thread.join(timeout=2 * _POLL_MS / 1000)
        if not (self._input_thread.is_alive() or self._output_thread.is_alive()):
            self._ctx.term()  # would wait for a socket still open
        return status

    def run_busy_loop(self) -> None:
        """Until SHUTDOWN: take the inputs (blocking while there is no work), step."""
        while self._process_input_queue():
            if self.has_work():
                outputs = self.step()
                stats = None
                if self._stats is not None and self._stats.latest is not None:
                    stats, self._stats.latest = dumps(self._stats.latest), None
                self.output_queue.put(EngineCoreOutputs(outputs=outputs, stats=stats))

    def _process_input_queue(self) -> bool:
        """Handle every queued input, waiting for one while there is no work (waking each
        ``engine.idle`` tick to keep a CPU's threads warm). False once SHUTDOWN came."""
        idle = self.engine.idle
        while True:
            try:
                if self.has_work() or not self.input_queue.empty():
                    item = self.input_queue.get_nowait()
                else:
                    item = self.input_queue.get(timeout=idle.timeout())
            except queue.Empty:
                if self.has_work():
                    return True
                idle.poke()
                continue
            if not self._handle(*item):
                self._shutdown()
                return False

    def _handle(self, kind: EngineCoreRequestType | None, payload: Any) -> bool:
        if kind is None:  # the input thread failed: payload is its exception
            raise payload
        if kind is EngineCoreRequestType.ADD:
            call_id, request = payload
            try:
                self.add_request(request)
                answer = UtilityOutput(call_id)
            except (ValueError, TypeError) as exc:
                answer = UtilityOutput(call_id, failure=dumps(exc))
            self.output_queue.put(EngineCoreOutputs(utility_output=answer))
        elif kind is EngineCoreRequestType.ABORT:
            finals = self.abort_requests(payload)
            if finals:
                self.output_queue.put(EngineCoreOutputs(outputs=finals))
        elif kind is EngineCoreRequestType.UTILITY:
            try:
                answer = UtilityOutput(payload.call_id,
                                       result=dumps(self.call_utility(payload.method,
                                                                      loads(payload.args))))
            except Exception as exc:  # handed to the caller
                answer = UtilityOutput(payload.call_id, failure=_dumps_exception(exc))
            self.output_queue.put(EngineCoreOutputs(utility_output=answer))
        elif kind is EngineCoreRequestType.SHUTDOWN:
            return False
        return True

    def _shutdown(self) -> None:
        """Leave the engine clean: requests in flight aborted, the aborts recorded."""
        unfinished = self.engine.get_unfinished_request_ids()
        if unfinished:
            self.engine.abort_request(unfinished)
            self.engine.step()

    # ------------------------------------------------------------------ the two socket threads
    def _process_input_socket(self, address: str) -> None:
        decoder = MsgpackDecoder()
        socket = self._ctx.socket(zmq.PULL)
        socket.connect(address)
        try:
            while True:
                if self._done.is_set():
                    return
                if not socket.poll(_POLL_MS):
                    if self.parent_pid is not None and os.getppid() != self.parent_pid:
                        logger.error("The client process is gone: the engine core shuts down.")
                        self.input_queue.put((EngineCoreRequestType.SHUTDOWN, None))
                        return
                    continue
                type_frame, *data = socket.recv_multipart()
                kind = EngineCoreRequestType(type_frame)
                if kind is EngineCoreRequestType.ADD:  # frames: type, call id, request
                    payload: Any = (int.from_bytes(data[0], "little"),
                                    decoder.decode_request(data[1]))
                elif kind is EngineCoreRequestType.ABORT:
                    payload = decoder.decode_ids(data[0])
                elif kind is EngineCoreRequestType.UTILITY:
                    payload = decoder.decode_utility(data[0])
                else:
                    payload = None
                self.input_queue.put((kind, payload))
                if kind is EngineCoreRequestType.SHUTDOWN:
                    return
        except BaseException as exc:  # the busy loop raises it
            self.input_queue.put((None, exc))
        finally:
            socket.close(linger=0)

    def _process_output_socket(self, address: str) -> None:
        encoder = MsgpackEncoder()
        socket = self._ctx.socket(zmq.PUSH)
        socket.connect(address)
        try:
            while (outputs := self.output_queue.get()) is not None:
                socket.send(encoder.encode(outputs))
        finally:
            socket.close(linger=5000)  # what was sent reaches the client before the exit


def main() -> None:
    """``python -c "from workbench.engine.core_proc import main; main()" IN OUT PARENT_PID``,
    the EngineConfig pickled on stdin (what an MP client runs)."""
    import pickle
    import sys

    input_address, output_address, parent_pid = sys.argv[1:4]
    config = pickle.load(sys.stdin.buffer)
    EngineCoreProc.run_engine_core(config, input_address, output_address, int(parent_pid))


def _dumps_exception(exc: BaseException) -> bytes:
    try:
        return dumps(exc)
    except Exception:  # an exception that does not pickle: its words survive
        return dumps(RuntimeError(repr(exc)))


def _send_dead(output_address: str, message: str) -> None:
    ctx = zmq.Context.instance()
    socket = ctx.socket(zmq.PUSH)
    socket.connect(output_address)
    socket.send(MsgpackEncoder().encode(EngineCoreOutputs(engine_dead=message)))
    socket.close(linger=5000)
