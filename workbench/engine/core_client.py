"""How a front end talks to its engine core (vLLM's ``EngineCoreClient`` shapes):

- :class:`InprocClient`: the core in this thread (``get_output()`` steps it);
- :class:`SyncMPClient`: the core in a child process (:class:`~workbench.engine.core_proc.EngineCoreProc`)
  over ZMQ, blocking calls;
- :class:`AsyncMPClient`: the same child process, ``async`` calls.

An MP client binds two ipc sockets (PUSH for requests, PULL for outputs), spawns the core
process, which connects to both, and waits for its handshake. One *output thread* per client
receives everything the core sends: utility answers resolve their futures, outputs go to the
client's consumer, and the core process's exit (its pidfd, polled beside the socket) or its
``engine_dead`` message marks the client dead: every pending call and every later one raises
:class:`~workbench.engine.exceptions.EngineDeadError`; nothing waits forever.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from workbench.engine.core_proc import EngineCore
from workbench.engine.engine_core_request import EngineCoreRequest
from workbench.engine.exceptions import EngineDeadError
from workbench.engine.llm_engine import LLMEngine
from workbench.engine.serial_utils import (EngineCoreOutputs, EngineCoreRequestType,
                                           MsgpackDecoder, MsgpackEncoder, UtilityCall, dumps,
                                           loads)
from workbench.outputs import RequestOutput

logger = logging.getLogger(__name__)
#: vLLM's variable: seconds to wait for the core process's handshake (its model load included).
READY_TIMEOUT_ENV = "VLLM_ENGINE_READY_TIMEOUT_S"
_EXIT_POLL_MS = 100  # without a pidfd (not Linux), how often the core process's exit is checked


def multiprocessing_enabled(flag: bool | None = None) -> bool:
    """Whether to run the core in a child process: ``flag`` when given (``EngineArgs
    .multiprocess_mode``, ``--multiprocess-mode``), else vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING``
    ("1": yes; unset: no, the steppable in-process engine that notebooks need)."""
    if flag:
        return True
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0").strip().lower() in ("1", "true")


class EngineCoreClient:
    """What every client does: add, abort, get outputs, call a utility method by name."""

    @staticmethod
    def make_client(multiprocess_mode: bool, asyncio_mode: bool, config=None, *,
                    engine=None) -> EngineCoreClient:
        """vLLM's factory: AsyncMPClient, SyncMPClient or InprocClient (``engine``, or one built
        from ``config``). An in-process asyncio client is AsyncLLM's engine thread, not a client."""
        if asyncio_mode and not multiprocess_mode:
            raise NotImplementedError("asyncio_mode needs multiprocess_mode: in process, AsyncLLM "
                                      "drives the engine from its engine thread.")
        if multiprocess_mode:
            return AsyncMPClient(config) if asyncio_mode else SyncMPClient(config)
        return InprocClient(engine if engine is not None else LLMEngine(config))

    def shutdown(self) -> None:
        raise NotImplementedError


class InprocClient(EngineCoreClient):
    """The core in this thread: ``get_output()`` runs one step (vLLM's InprocClient). Abort
    outputs come with the next ``get_output()``, as from a core process."""

    def __init__(self, engine) -> None:
        self.engine_core = EngineCore(engine)
        self._finals: list[RequestOutput] = []

    def get_output(self) -> EngineCoreOutputs:
        finals, self._finals = self._finals, []
        stepped = self.engine_core.step() if self.engine_core.has_work() else []
        return EngineCoreOutputs(outputs=finals + stepped)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._finals += self.engine_core.abort_requests(request_ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.engine_core.call_utility(method, args)

    def shutdown(self) -> None:
        pass


class MPClient(EngineCoreClient):
    """The core in a spawned child process (see the module). ``model_config``, ``config``
    and ``input_processor`` are the core's own, shipped in its handshake (its tokenizer
    included), so this process processes inputs exactly as the core would.

    ``on_outputs(outputs)`` and ``on_dead(error)`` run on the output thread, in the order the
    core sent the messages; ``on_dead`` runs once, after every output that arrived."""

    def __init__(self, config, *, on_outputs: Callable[[EngineCoreOutputs], None],
                 on_dead: Callable[[EngineDeadError], None]) -> None:
        self._on_outputs, self._on_dead = on_outputs, on_dead
        self._encoder, self._decoder = MsgpackEncoder(), MsgpackDecoder()
        self._dir = tempfile.mkdtemp(prefix="workbench-core-")
        input_address, output_address = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._ctx = zmq.Context()
        self.input_socket = self._ctx.socket(zmq.PUSH)
        self.input_socket.bind(input_address)
        self._output_socket = self._ctx.socket(zmq.PULL)
        self._output_socket.bind(output_address)
        self._send_lock = threading.Lock()  # ZMQ sockets are not thread-safe
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count(1)
        self._lock = threading.Lock()  # _calls and the dead state
        self.dead_error: EngineDeadError | None = None  # set once the core is gone
        self._stopping = False  # shutdown() asked: the core's exit is no error
        self._wake_r, self._wake_w = os.pipe()  # shutdown() wakes the output thread
        # A fresh interpreter (not a fork: this process may hold threads and an OpenMP pool;
        # not multiprocessing's spawn: it would re-run the caller's __main__ script).
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from workbench.engine.core_proc import main; main()",
             input_address, output_address, str(os.getpid())], stdin=subprocess.PIPE)
        self._proc_fd = os.pidfd_open(self.proc.pid) if hasattr(os, "pidfd_open") else None
        try:
            self.proc.stdin.write(dumps(config))
            self.proc.stdin.close()
            facts = self._wait_for_handshake(float(os.environ.get(READY_TIMEOUT_ENV, "600")))
        except BaseException:
            self._stop_process()
            self._close()
            raise
        self.model_config = facts["model_config"]
        self.config = facts["config"]
        self.input_processor = facts["input_processor"]
        self.scheduler_stats = facts["scheduler_stats"]
        self._output_thread = threading.Thread(target=self._process_outputs_socket,
                                               name="workbench-core-client-output", daemon=True)
        self._output_thread.start()

    # ------------------------------------------------------------------ sending
    @property
    def stopping(self) -> bool:
        """Whether shutdown() was called (the core's exit is then no error)."""
        return self._stopping

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and not self._stopping

    def ensure_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self._stopping:
            raise EngineDeadError("The engine is shut down.")

    def _send(self, kind: EngineCoreRequestType, *frames: bytes) -> None:
        with self._send_lock:
            self.ensure_alive()
            self.input_socket.send_multipart((kind.value, *frames))

    def _new_call(self) -> tuple[int, concurrent.futures.Future]:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.dead_error is not None:
                future.set_exception(self.dead_error)
                return 0, future
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        return call_id, future

    def _send_add(self, request: EngineCoreRequest) -> concurrent.futures.Future:
        """Send an ADD; the future resolves once the core queued it (or raises its refusal)."""
        return self._call(lambda call_id: (EngineCoreRequestType.ADD, call_id.to_bytes(8, "little"),
                                           self._encoder.encode_request(request)))

    def _send_abort(self, request_ids: list[str]) -> None:
        if request_ids and self.is_alive:
            self._send(EngineCoreRequestType.ABORT, self._encoder.encode(list(request_ids)))

    def _send_utility(self, method: str, args: tuple) -> concurrent.futures.Future:
        return self._call(lambda call_id: (EngineCoreRequestType.UTILITY, self._encoder.encode(
            UtilityCall(call_id, method, dumps(args)))))

    def _call(self, message: Callable[[int], tuple]) -> concurrent.futures.Future:
        """Send ``message(call_id)``; the future of its answer (already failed when the core
        is dead). An encoding or sending error is raised here, the call forgotten."""
        call_id, future = self._new_call()
        if call_id:
            try:
                self._send(*message(call_id))
            except BaseException:
                with self._lock:
                    self._calls.pop(call_id, None)
                raise
        return future

    # ------------------------------------------------------------------ receiving
    def _poller(self, *extra) -> zmq.Poller:
        """Polls the output socket, the core process's exit (its pidfd; without one, the
        caller polls ``proc.poll()`` at each timeout) and ``extra`` file descriptors."""
        poller = zmq.Poller()
        poller.register(self._output_socket, zmq.POLLIN)
        for fd in (self._proc_fd, *extra):
            if fd is not None:
                poller.register(fd, zmq.POLLIN)
        return poller

    def _exited(self, events: dict) -> bool:
        return (self._proc_fd in events) if self._proc_fd is not None else self.proc.poll() is not None

    def _wait_for_handshake(self, timeout: float) -> dict:
        poller = self._poller()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            events = dict(poller.poll(_EXIT_POLL_MS))
            if self._output_socket in events:
                message = self._decoder.decode_outputs(self._output_socket.recv())
                if message.ready is not None:
                    return loads(message.ready)
                raise RuntimeError(message.engine_dead or "The engine core sent no handshake.")
            if self._exited(events):
                raise RuntimeError(f"The engine core process exited (code {self.proc.wait()}) "
                                   f"before its handshake.")
        raise TimeoutError(f"The engine core process sent no handshake in {timeout:g} s "
                           f"({READY_TIMEOUT_ENV}).")

    def _process_outputs_socket(self) -> None:
        socket = self._output_socket
        poller = self._poller(self._wake_r)
        error = None
        try:
            while error is None:
                events = dict(poller.poll(None if self._proc_fd is not None else _EXIT_POLL_MS))
                while error is None and socket.poll(0):  # everything sent before an exit
                    error = self._handle(self._decoder.decode_outputs(socket.recv()))
                if error is None and self._exited(events):
                    code = self.proc.wait()
                    error = ("The engine is shut down." if self._stopping else
                             f"The engine core process (pid {self.proc.pid}) died "
                             f"unexpectedly (exit code {code}).")
                if error is None and self._wake_r in events:
                    error = "The engine is shut down."
        except BaseException as exc:  # a broken socket: the core is unreachable
            error = f"The engine core's output socket failed: {exc!r}"
        self._set_dead(EngineDeadError(error))

    def _handle(self, message: EngineCoreOutputs) -> str | None:
        """Deliver one message; the core's last words when it is ``engine_dead``."""
        if message.engine_dead is not None:
            return message.engine_dead
        answer = message.utility_output
        if answer is not None:
            with self._lock:
                future = self._calls.pop(answer.call_id, None)
            if future is not None and future.set_running_or_notify_cancel():
                if answer.failure is not None:
                    future.set_exception(loads(answer.failure))
                else:
                    future.set_result(None if answer.result is None else loads(answer.result))
        if message.outputs or message.stats is not None:
            if message.stats is not None:
                self.scheduler_stats = loads(message.stats)[0]
            self._on_outputs(message)
        return None

    def _set_dead(self, error: EngineDeadError) -> None:
        with self._lock:
            if self.dead_error is not None:
                return
            self.dead_error = error
            pending, self._calls = self._calls, {}
        if not self._stopping:
            logger.error("%s", error)
        for future in pending.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        self._on_dead(error)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stop the core (requests in flight aborted there), the output thread, the sockets."""
        if self._stopping:
            return
        alive = self.dead_error is None
        if alive:
            try:
                with self._send_lock:
                    self.input_socket.send_multipart((EngineCoreRequestType.SHUTDOWN.value,))
            except zmq.ZMQError:
                pass
        self._stopping = True
        self._stop_process(graceful=alive)
        os.write(self._wake_w, b"x")
        self._output_thread.join(timeout=10)
        self._close()

    def _stop_process(self, graceful: bool = False) -> None:
        proc = self.proc
        for stop, wait in ((None, 10 if graceful else 0), (proc.terminate, 5), (proc.kill, None)):
            if proc.poll() is not None:
                return
            if stop is not None:
                stop()
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass

    def _close(self) -> None:
        self.input_socket.close(linger=0)
        self._output_socket.close(linger=0)
        self._ctx.term()
        for fd in (self._wake_r, self._wake_w, self._proc_fd):
            if fd is not None:
                os.close(fd)
        shutil.rmtree(self._dir, ignore_errors=True)


class SyncMPClient(MPClient):
    """Blocking calls to a core process (vLLM's SyncMPClient): ``get_output()`` waits for the
    next step's outputs; a dead core raises EngineDeadError there and in every call."""

    def __init__(self, config) -> None:
        self._outputs: collections.deque = collections.deque()
        self._ready = threading.Condition()
        super().__init__(config, on_outputs=self._push, on_dead=self._push)

    def _push(self, item) -> None:
        with self._ready:
            self._outputs.append(item)
            self._ready.notify_all()

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next outputs message (TimeoutError after ``timeout`` seconds)."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._outputs, timeout):
                raise TimeoutError(f"no engine core output in {timeout} s")
            item = self._outputs[0]
            if isinstance(item, EngineDeadError):
                raise item  # kept: every later get_output raises it too
            return self._outputs.popleft()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue it in the core; returns once it is queued (ValueError: the core refused it)."""
        self._send_add(request).result()

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort them in the core; their final "abort" outputs come from ``get_output()``."""
        self._send_abort(request_ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        """``EngineCore.<method>(*args)`` in the core process (e.g. ``"get_history"``)."""
        return self._send_utility(method, args).result()


class AsyncMPClient(MPClient):
    """``async`` calls to a core process (vLLM's AsyncMPClient), usable from any event loop.

    ``get_output_async()`` returns the outputs in order, unless :meth:`set_handlers` gave an
    output handler, which then receives every outputs message on the client's output thread
    (AsyncLLM's, which hands them to each request's loop)."""

    def __init__(self, config) -> None:
        self._outputs: collections.deque = collections.deque()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._queue_lock = threading.Lock()
        self._output_handler: Callable[[EngineCoreOutputs], None] | None = None
        self._dead_handler: Callable[[EngineDeadError], None] | None = None
        super().__init__(config, on_outputs=self._output, on_dead=self._dead)

    def set_handlers(self, output_handler: Callable[[EngineCoreOutputs], None],
                     dead_handler: Callable[[EngineDeadError], None]) -> None:
        """Send every outputs message to ``output_handler`` and the death to ``dead_handler``
        (both on the output thread), before any request is added."""
        self._output_handler, self._dead_handler = output_handler, dead_handler
        if self.dead_error is not None:  # died already
            dead_handler(self.dead_error)

    def _output(self, message: EngineCoreOutputs) -> None:
        (self._output_handler or self._push)(message)

    def _dead(self, error: EngineDeadError) -> None:
        self._push(error)
        if self._dead_handler is not None:
            self._dead_handler(error)

    def _push(self, item) -> None:
        with self._queue_lock:
            self._outputs.append(item)
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))
            except RuntimeError:  # that loop is closed
                pass

    async def get_output_async(self) -> EngineCoreOutputs:
        loop = asyncio.get_running_loop()
        while True:
            with self._queue_lock:
                if self._outputs:
                    item = self._outputs[0]
                    if isinstance(item, EngineDeadError):
                        raise item
                    return self._outputs.popleft()
                future = loop.create_future()
                self._waiters.append((loop, future))
            await future

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        """Queue it in the core; returns once queued (ValueError: the core refused it)."""
        await asyncio.wrap_future(self._send_add(request))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self._send_abort(request_ids)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Send the abort (never waits: callable from a stream's close())."""
        self._send_abort(request_ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self._send_utility(method, args))

    def call_utility(self, method: str, *args: Any) -> Any:
        """The blocking form, for a thread with no event loop (server start-up)."""
        return self._send_utility(method, args).result()
