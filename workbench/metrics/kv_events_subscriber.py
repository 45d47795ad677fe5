"""KVEventSubscriber: reads a publisher's KV event batches as vLLM's example subscriber does.

A SUB socket on the publisher's ``endpoint`` (``topic`` prefix) and a DEALER socket on its
``replay_endpoint``. ``receive(timeout)`` returns the ``(sequence, KVEventBatch)`` messages in
order: when a message's sequence skips some (the subscriber joined late, or missed them),
the missing ones are asked of the replay socket first (vLLM's example does this with a REQ
socket, which takes one reply per request; a DEALER takes them all). ``start_seq``: the first
sequence wanted (0: everything still in the publisher's buffer; None: from the first message
received, as vLLM's example).
"""

from __future__ import annotations

import msgspec
import zmq

from workbench.core.kv_event_batch import KVEventBatch
from workbench.metrics.kv_events_publisher import END_SEQ


class KVEventSubscriber:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 start_seq: int | None = 0) -> None:
        self.context = zmq.Context.instance()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.replay = None
        if replay_endpoint is not None:
            self.replay = self.context.socket(zmq.DEALER)
            self.replay.connect(replay_endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.last_seq = -1 if start_seq is None else start_seq - 1
        self._joined = start_seq is not None

    def receive(self, timeout_ms: int = 100) -> list[tuple[int, KVEventBatch]]:
        """Every message available within ``timeout_ms`` (waiting only for the first), gaps filled."""
        out: list[tuple[int, KVEventBatch]] = []
        wait = timeout_ms
        while self.sub.poll(wait):
            _, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if not self._joined:
                self.last_seq, self._joined = seq - 1, True
            if seq > self.last_seq + 1 and self.replay is not None:
                out.extend(self._replay(self.last_seq + 1, seq))
            if seq > self.last_seq:
                out.append((seq, self.decoder.decode(payload)))
                self.last_seq = seq
            wait = 0
        return out

    def _replay(self, start: int, before: int, timeout_ms: int = 1000) -> list[tuple[int, KVEventBatch]]:
        self.replay.send_multipart((b"", start.to_bytes(8, "big")))
        got = []
        while self.replay.poll(timeout_ms):
            _, seq_bytes, payload = self.replay.recv_multipart()
            if seq_bytes == END_SEQ:
                break
            seq = int.from_bytes(seq_bytes, "big")
            if self.last_seq < seq < before:
                got.append((seq, self.decoder.decode(payload)))
                self.last_seq = seq
        return got

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
