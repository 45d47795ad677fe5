"""KV events published over ZMQ as vLLM publishes them: KVEventsConfig and ZmqEventPublisher.

``KVEventsConfig`` has vLLM's fields and defaults (``--kv-events-config JSON`` on
``workbench serve``). With ``enable_kv_cache_events`` an engine publishes, after every step
that changed its prefix cache, one :class:`~workbench.core.kv_event_batch.KVEventBatch`
(msgpack by msgspec) as a three-frame message on a ZMQ PUB socket bound at ``endpoint``::

    (topic, sequence, payload)      sequence: 8-byte big-endian, 0, 1, 2, ...

and keeps the last ``buffer_steps`` messages for the replay socket (a ROUTER bound at
``replay_endpoint``, when given): a client that sends ``(b"", start.to_bytes(8, "big"))``
(what a REQ socket sends for ``start.to_bytes(8, "big")``) gets every buffered
``(b"", sequence, payload)`` from ``start`` on, then ``(b"", END_SEQ, b"")``.

The sockets live on one background thread (ZMQ sockets are not thread-safe), fed by a
queue; ``publish`` never blocks the engine's step. ``attach(engine, config)`` hooks a
publisher onto an engine's ``on_step``.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, fields

import msgspec
import zmq

from workbench.core.kv_event_batch import KVEventBatch, to_kv_event_batch

logger = logging.getLogger(__name__)

#: The sequence number of the replay's end marker (-1, signed, 8 bytes big-endian), as vLLM's.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
PUBLISHERS = ("null", "zmq")


@dataclass
class KVEventsConfig:
    """vLLM's KV events configuration. ``publisher``: ``"zmq"`` or ``"null"`` (None: ``"zmq"``
    when events are enabled, else ``"null"``)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {PUBLISHERS}, got {self.publisher!r}.")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1, got {value!r}.")

    @classmethod
    def from_json(cls, text: str | dict) -> KVEventsConfig:
        """From ``--kv-events-config``'s JSON (or its dict); unknown keys are a ValueError."""
        data = json.loads(text) if isinstance(text, str) else dict(text)
        if not isinstance(data, dict):
            raise ValueError(f"--kv-events-config must be a JSON object, got {text!r}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {unknown}; known: {sorted(known)}.")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


class ZmqEventPublisher:
    """Publishes KVEventBatches on ``config.endpoint`` and answers replays on
    ``config.replay_endpoint`` (see the module docstring). ``shutdown()`` closes it."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config, self.data_parallel_rank = config, data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._running = True
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="kv-events-publisher", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise ValueError(f"kv_events_config: cannot bind {config.endpoint!r} / {config.replay_endpoint!r}: "
                             f"{self._error}") from self._error

    def publish(self, batch: KVEventBatch) -> None:
        """Queue ``batch`` for sending (dropped, with a warning, when the queue is full)."""
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            logger.warning("KV events queue full (%d); a batch was dropped", self.config.max_queue_size)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until every queued batch was sent."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.001)

    def shutdown(self) -> None:
        self.flush()
        self._running = False
        self._thread.join(timeout=5.0)

    def _serve(self) -> None:
        context = zmq.Context.instance()
        pub = replay = None
        try:
            pub = context.socket(zmq.PUB)
            pub.set_hwm(self.config.hwm)
            pub.bind(self.config.endpoint)
            if self.config.replay_endpoint is not None:
                replay = context.socket(zmq.ROUTER)
                replay.bind(self.config.replay_endpoint)
        except zmq.ZMQError as e:
            self._error = e
            for s in (pub, replay):
                if s is not None:
                    s.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        topic = self.config.topic.encode()
        try:
            while self._running or not self._queue.empty():
                if replay is not None and poller.poll(0):
                    self._answer_replay(replay)
                try:
                    batch = self._queue.get(timeout=0.005)
                except queue.Empty:
                    continue
                payload = self._encoder.encode(batch)
                seq = self._seq
                self._seq += 1
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self._queue.task_done()
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _answer_replay(self, replay) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("invalid KV events replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))


def medium_of(engine) -> str:
    """The KV cache's tier as vLLM names it: ``"GPU"`` on an accelerator, else ``"CPU"``."""
    return "CPU" if str(getattr(engine, "device", "cpu")).startswith("cpu") else "GPU"


def attach(engine, config: KVEventsConfig, data_parallel_rank: int = 0) -> ZmqEventPublisher | None:
    """Publish ``engine``'s KV events after every step that has some (None for the null publisher)."""
    if not config.enable_kv_cache_events or config.publisher == "null":
        return None
    publisher = ZmqEventPublisher(config, data_parallel_rank)
    medium = medium_of(engine)

    def on_step(record) -> None:
        batch = to_kv_event_batch(record.kv_events, ts=time.time(), data_parallel_rank=data_parallel_rank,
                                  medium=medium)
        if batch.events:
            publisher.publish(batch)

    engine.on_step.append(on_step)
    return publisher
