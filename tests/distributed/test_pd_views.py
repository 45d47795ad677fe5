"""The transfer, seen: the consumer's WAITING_FOR_REMOTE_KVS span and the producer's held
blocks on the request timeline, and the kv transfers track of the Perfetto export, checked
against the steps and the modelled link worked out by hand."""

import json

import transformers

from test_in_process_connector import PROMPTS, disaggregate, engine
from workbench import default_model_path
from workbench.metrics.perfetto import write_trace
from workbench.metrics.prometheus import PrometheusStatLogger
from workbench.viz.block_map import BlockMap
from workbench.viz.kv_transfer import kv_transfer_notes
from workbench.viz.timeline import request_spans

LINK = {"link_bandwidth_gbps": 8.0, "link_latency_s": 0.002, "link_per_block_s": 0.0005}


def test_timeline_and_perfetto_show_the_transfer(tmp_path):
    ids = transformers.AutoTokenizer.from_pretrained(default_model_path())(PROMPTS[2]).input_ids
    prefill, decode = engine("kv_producer", "p-view", extra=LINK), engine("kv_consumer", "d-view", extra=LINK)
    disaggregate(prefill, decode, [ids])
    n = -(-(len(ids) - 1) // 4)
    seconds = 0.002 + n * 0.0005 + n * 12288 * 8 / 8e9
    # decode: the load starts at its step 0 and lands in it (the empty step waits for the link)
    (wait,) = [s for s in request_spans(decode.history)[1] if s["kind"] == "waiting_for_remote_kvs"]
    assert (wait["start"], wait["end"], wait["num_bytes"]) == (0, 1, n * 12288)
    assert abs(wait["seconds"] - seconds) < 1e-9  # end - start on a wall clock of ~1e5 s
    # prefill: finished at step 0, its blocks held until its step 1 learned they were read
    (held,) = [s for s in request_spans(prefill.history)[1] if s["kind"] == "kv_held"]
    assert (held["start"], held["end"]) == (0, 2)
    # the block map: after step 0 the finished r0's blocks are held (dotted), after step 1 freed
    held_map = BlockMap(prefill, step=0)
    assert held_map.held == set(held_map.block_table("r0")) and len(held_map.held) == -(-len(ids) // 4)
    assert "held for a peer" in held_map.grid.value and "dotted outline" in held_map.legend.value
    assert BlockMap(prefill, step=1).held == set() and BlockMap(decode, step=1).held == set()
    path = write_trace(tmp_path / "pd.json", [("prefill", list(prefill.history)), ("decode", list(decode.history))])
    events = json.loads(path.read_text())["traceEvents"]
    (transfer,) = [e for e in events if e["name"] == "kv transfer r0"]
    assert transfer["pid"] == 2 and transfer["args"]["num_bytes"] == n * 12288
    assert abs(transfer["dur"] - 1e6 * seconds) < 1e-2  # microseconds
    assert [e["pid"] for e in events if e["name"] == "kv held r0"] == [1]
    notes = [n for rec in decode.history for n in kv_transfer_notes(rec)]
    assert notes[0].startswith(f"r0 waits for remote KV (WAITING_FOR_REMOTE_KVS): {n} blocks")
    assert [n for rec in prefill.history for n in kv_transfer_notes(rec)] == [
        "r0's blocks, held for a peer, were read: freed"]
    metrics = PrometheusStatLogger("tiny")
    for rec in decode.history:
        metrics.record(rec.scheduler_stats, rec.iteration_stats)
    samples = {sample.name: sample.value for m in metrics.registry.collect() for sample in m.samples}
    assert samples["vllm:nixl_xfer_time_seconds_count"] == 1
    assert abs(samples["vllm:nixl_xfer_time_seconds_sum"] - seconds) < 1e-9
    assert samples["vllm:nixl_bytes_transferred_sum"] == n * 12288
    assert samples["vllm:nixl_num_descriptors_sum"] == n
