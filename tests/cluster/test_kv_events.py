"""KV events over ZMQ as vLLM publishes them: decoded with vLLM's schema alone, an index that
equals the live prefix cache after every step, a late subscriber caught up by replay."""

import time
from typing import Any

import msgspec
import pytest
import zmq

from workbench import EngineArgs, LLMEngine, SamplingParams
from workbench.cluster import KVBlockIndex
from workbench.metrics.kv_events_publisher import KVEventsConfig, attach
from workbench.metrics.kv_events_subscriber import KVEventSubscriber


# vLLM's wire schema, written from vllm/distributed/kv_events.py (no workbench type used).
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def _live_hashes(engine) -> set:
    return {b.block_hash for b in engine.kv_cache.blocks if b.block_hash is not None}


def _receive_until(sub, n, deadline_s=5.0):
    got, end = [], time.monotonic() + deadline_s
    while len(got) < n and time.monotonic() < end:
        got += sub.receive(timeout_ms=50)
    return got


@pytest.fixture
def endpoints(tmp_path):
    return f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay"


def test_a_subscriber_reads_every_event_and_its_index_is_the_live_prefix_cache(endpoints):
    endpoint, replay_endpoint = endpoints
    config = KVEventsConfig.from_json({"enable_kv_cache_events": True, "endpoint": endpoint,
                                       "replay_endpoint": replay_endpoint, "topic": "kv-events"})
    assert config.publisher == "zmq"
    engine = LLMEngine.from_engine_args(EngineArgs(block_size=4, num_kv_blocks=10, max_num_seqs=2,
                                                   max_num_batched_tokens=32))
    publisher = attach(engine, config)
    raw = zmq.Context.instance().socket(zmq.SUB)  # vLLM's example: a SUB socket on the topic
    raw.connect(endpoint)
    raw.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    sub = KVEventSubscriber(endpoint, replay_endpoint, topic="kv-events", start_seq=0)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    index, kinds, raw_seqs = KVBlockIndex(), set(), []
    try:
        time.sleep(0.2)  # let both subscriptions reach the publisher
        prompts = ["ROMEO: good morrow, sweet friend", "ROMEO: good morrow, sweet lady", "JULIET: alas",
                   "ROMEO: good morrow, sweet friend", "HAMLET: to be or not to be, that is the question"]
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=6))
        seq = 0
        while engine.has_unfinished_requests():
            engine.step()
            publisher.flush()
            stored = [e for e in engine.history[-1].kv_events if type(e).__name__ in ("BlockStored", "BlockRemoved")]
            for s, batch in _receive_until(sub, 1 if stored else 0, deadline_s=5.0 if stored else 0.05):
                assert s == seq
                seq += 1
                index.apply(0, batch)
            assert index.blocks.get(0, set()) == _live_hashes(engine)  # after every step
        while raw.poll(200):
            topic, seq_bytes, payload = raw.recv_multipart()
            assert topic == b"kv-events"
            raw_seqs.append(int.from_bytes(seq_bytes, "big"))
            batch = decoder.decode(payload)
            assert batch.data_parallel_rank == 0 and batch.events
            kinds |= {type(e).__name__ for e in batch.events}
            for e in batch.events:
                if isinstance(e, BlockStored):
                    assert e.block_size == 4 and len(e.token_ids) == 4 * len(e.block_hashes) and e.medium == "CPU"
        assert raw_seqs == list(range(seq)) and seq > 0
        assert kinds == {"BlockStored", "BlockRemoved"}  # the pool was small enough to evict
    finally:
        raw.close(linger=0)
        sub.close()
        publisher.shutdown()


def test_a_late_subscriber_catches_up_through_the_replay_socket(endpoints):
    endpoint, replay_endpoint = endpoints
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=replay_endpoint)
    engine = LLMEngine.from_engine_args(EngineArgs(block_size=4, num_kv_blocks=32))
    publisher = attach(engine, config)
    late = None
    try:
        for i, p in enumerate(["ROMEO: good morrow", "JULIET: alas, poor Romeo", "ROMEO: good morrow, lady"]):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=4))
        while engine.has_unfinished_requests():
            engine.step()
        publisher.flush()
        missed = publisher._seq
        assert missed > 0
        late = KVEventSubscriber(endpoint, replay_endpoint, start_seq=0)
        time.sleep(0.2)
        engine.add_request("new", "HAMLET: words, words, words", SamplingParams(temperature=0, max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()
        publisher.flush()
        got = _receive_until(late, missed + 1)
        assert [s for s, _ in got] == list(range(len(got))) and len(got) >= missed + 1
        index = KVBlockIndex()
        for _, batch in got:
            index.apply(0, batch)
        assert index.blocks[0] == _live_hashes(engine)
    finally:
        if late is not None:
            late.close()
        publisher.shutdown()


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="unknown field"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "port": 1}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig(enable_kv_cache_events=True, publisher="kafka")
    assert KVEventsConfig().publisher == "null"


def test_workbench_serve_publishes_kv_events(tmp_path):
    """`workbench serve --kv-events-config JSON`: a completion's prompt blocks reach a subscriber."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"ipc://{tmp_path}/kv"
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": endpoint + "-replay"})
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "workbench", "serve", "--port", str(port), "--block-size", "4",
                             "--kv-events-config", config], stdout=log, stderr=log, start_new_session=True)
    sub = KVEventSubscriber(endpoint, endpoint + "-replay", start_seq=0)
    try:
        up_by = time.monotonic() + 180  # a loaded CI machine starts a server slowly
        while time.monotonic() < up_by and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": "tiny-shakespeare", "prompt": "ROMEO: good morrow, sweet friend",
                                 "max_tokens": 3, "temperature": 0})
        assert reply.status_code == 200
        got = _receive_until(sub, 1, deadline_s=30)
        stored = [e for _, b in got for e in b.events if type(e).__name__ == "BlockStored"]
        assert stored and all(e.block_size == 4 for e in stored)
    finally:
        sub.close()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def test_serve_refuses_a_bad_kv_events_config(capsys):
    from workbench.entrypoints.cli import main

    assert main(["serve", "--kv-events-config", '{"enable_kv_cache_events": true, "port": 5}']) == 2
    assert "unknown field(s) ['port']" in capsys.readouterr().err
