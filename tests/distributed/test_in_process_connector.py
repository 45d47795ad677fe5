"""Prefill on one engine, decode on another (vLLM's KV connector, in process).

References the code does not produce: transformers' greedy tokens and a colocated engine's;
the producer's own KV tensors; a timeline worked out by hand from the model's shape and the
link. Both engines keep their invariants after every step and end with every block free.
"""

import json

import pytest
import torch
import transformers

from workbench import LLMEngine, SamplingParams, default_model_path
from workbench.benchmarks.checks import hf_greedy
from workbench.config import KVTransferConfig
from workbench.request import RequestStatus

PROMPTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "HAMLET:\nTo be, or not to be, that is the question:",
    "KING HENRY:\nOnce more unto the breach, dear friends, once more;",
]
MAX_TOKENS = 10


def engine(role=None, engine_id=None, clock=None, extra=None, **kw):
    kv = None if role is None else {"kv_role": role, "engine_id": engine_id,
                                     "kv_connector_extra_config": extra or {}}
    config = {**dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=40, max_num_seqs=4,
                     max_num_batched_tokens=32, kv_transfer_config=kv), **kw}
    return LLMEngine(clock=clock, **config) if clock is not None else LLMEngine(**config)


def prefill_params(**kw):
    return SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}, **kw)


def decode_params(kv_transfer_params, max_tokens=MAX_TOKENS):
    return SamplingParams(temperature=0, max_tokens=max_tokens,
                          extra_args={"kv_transfer_params": kv_transfer_params})


def check(*engines):
    for e in engines:
        e.scheduler.check_invariants()


def all_free(*engines):
    return all(e.kv_cache.num_free_blocks == e.kv_cache.num_blocks for e in engines)


def disaggregate(prefill, decode, prompts, *, on_step=None, max_steps=500):
    """vLLM's proxy by hand: each prompt to ``prefill`` with max_tokens=1 and do_remote_decode,
    then to ``decode`` with the params it returned. Both step alternately, invariants checked
    after every step. Returns {id: final decode output}."""
    for i, ids in enumerate(prompts):
        prefill.add_request(f"r{i}", {"prompt_token_ids": ids}, prefill_params())
    finals, steps = {}, 0
    while (prefill.has_unfinished_requests() or decode.has_unfinished_requests()
           or prefill.scheduler.has_kv_transfers()):
        for out in prefill.step():
            if out.finished and out.kv_transfer_params is not None:
                decode.add_request(out.request_id, {"prompt_token_ids": out.prompt_token_ids},
                                   decode_params(out.kv_transfer_params))
        for out in decode.step():
            if out.finished:
                finals[out.request_id] = out
        check(prefill, decode)
        if on_step is not None:
            on_step(steps)
        steps += 1
        assert steps < max_steps, "the transfers never completed"
    return finals


@pytest.fixture(scope="module")
def tiny():
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return model, [tokenizer(p).input_ids for p in PROMPTS]


def colocated(prompts):
    e = engine()
    for i, ids in enumerate(prompts):
        e.add_request(f"r{i}", {"prompt_token_ids": ids},
                      SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    outs = {}
    while e.has_unfinished_requests():
        outs.update({o.request_id: o for o in e.step() if o.finished})
    return outs


def test_disaggregated_equals_colocated_and_transformers_with_preemption_on_decode(tiny):
    model, prompts = tiny
    prefill = engine("kv_producer", "p-parity")
    decode = engine("kv_consumer", "d-parity", num_kv_blocks=12)  # tight: preempts
    finals = disaggregate(prefill, decode, prompts)
    ref = colocated(prompts)
    assert sum(o.metrics.num_preemptions for o in finals.values()) > 0, "no preemption on decode"
    for i, ids in enumerate(prompts):
        theirs, _ = hf_greedy(model, ids, MAX_TOKENS, stop_at_eos=True)
        assert finals[f"r{i}"].outputs[0].token_ids == ref[f"r{i}"].outputs[0].token_ids == theirs
    assert all_free(prefill, decode)
    assert not prefill.scheduler.held_for_transfer


def test_decode_computes_only_the_last_prompt_token_and_gets_the_producers_blocks(tiny):
    _, prompts = tiny
    prefill, decode = engine("kv_producer", "p-copy"), engine("kv_consumer", "d-copy")
    ids = prompts[0]
    prefill.add_request("r", {"prompt_token_ids": ids}, prefill_params())
    out = [o for o in prefill.step() if o.finished][0]
    params = out.kv_transfer_params
    assert params["do_remote_prefill"] and params["remote_engine_id"] == "p-copy"
    remote = params["remote_block_ids"]
    assert remote == prefill.kv_cache.block_table("r")  # held after finishing
    assert prefill.kv_cache.num_free_blocks == prefill.kv_cache.num_blocks - len(remote)
    decode.add_request("r", {"prompt_token_ids": ids}, decode_params(params))
    decode.step()  # allocates, loads, waits for the modelled end
    request = decode.scheduler.requests["r"]
    local = decode.kv_cache.block_table("r")
    n = -(-(len(ids) - 1) // 4)
    assert len(local) == n
    for (k, v), (pk, pv) in zip(decode.runner.kv_caches, prefill.runner.kv_caches):
        assert torch.equal(k[local], pk[remote[:n]]) and torch.equal(v[local], pv[remote[:n]])
    decode.step()
    assert request.status is RequestStatus.RUNNING
    chunk = decode.history[-1].scheduler_output.scheduled[0]
    assert (chunk.num_computed_tokens, chunk.num_new_tokens) == (len(ids) - 1, 1)


def test_prefix_hits_on_either_side_shorten_the_work(tiny):
    _, prompts = tiny
    prefill, decode = engine("kv_producer", "p-hit"), engine("kv_consumer", "d-hit")
    base = prompts[3]  # 4 full blocks are shared with the warm-up below
    warm = base[:17] + [5, 6, 7]
    for e in (prefill, decode):  # each side caches the shared prefix
        e.add_request("warm", {"prompt_token_ids": warm}, SamplingParams(temperature=0, max_tokens=1))
        while e.has_unfinished_requests():
            e.step()
    transfers = []
    decode.on_step.append(lambda rec: transfers.extend(rec.kv_connector_output.transfers))
    finals = disaggregate(prefill, decode, [base])
    hits = [r for r in prefill.history if r.scheduler_output.num_prefix_cache_hit_tokens]
    assert hits and hits[-1].scheduler_output.num_prefix_cache_hit_tokens == 16  # the producer's hit
    (transfer,) = transfers
    assert transfer.num_blocks == -(-(len(base) - 1) // 4) - 4  # the consumer's 4 blocks stay local
    assert finals["r0"].outputs[0].token_ids == colocated([base])["r0"].outputs[0].token_ids
    assert all_free(prefill, decode)


@pytest.mark.parametrize("when", ["before", "during", "after", "never_sent"])
def test_aborts_leak_no_block(tiny, when):
    _, prompts = tiny
    clock = ManualClock()
    extra = {"link_latency_s": 1.0, "abort_timeout_s": 30.0}
    prefill = engine("kv_producer", f"p-abort-{when}", clock=clock, extra=extra)
    decode = engine("kv_consumer", f"d-abort-{when}", clock=clock, extra=extra)
    prefill.add_request("r", {"prompt_token_ids": prompts[1]}, prefill_params())
    params = [o for o in prefill.step() if o.finished][0].kv_transfer_params
    if when != "never_sent":
        decode.add_request("r", {"prompt_token_ids": prompts[1]}, decode_params(params))
    if when == "before":  # still WAITING, no block yet
        decode.abort_request("r")
    if when in ("during", "after"):
        decode.runner._wait_until = lambda when: None  # hold the clock: the load is in flight
        decode.step()
        assert decode.scheduler.requests["r"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
        if when == "after":
            clock.now += 1.5
            decode.step()
            decode.step()
            assert decode.scheduler.requests["r"].status is RequestStatus.RUNNING
        decode.abort_request("r")
    for i in range(6):
        clock.now += 10.0  # past the link (1 s); from the fourth, past the abort timeout (30 s)
        decode.step()
        prefill.step()
        check(prefill, decode)
        if i == 1:  # t = 20 s: released by the consumer, or held until the timeout
            assert bool(prefill.scheduler.held_for_transfer) == (when == "never_sent")
    assert all_free(prefill, decode)
    assert not prefill.scheduler.held_for_transfer and not decode.scheduler.requests


class ManualClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def test_one_request_through_1p1d_on_a_known_link_hand_worked(tiny):
    """Link: 8 Gb/s (1 byte/ns), 2 ms latency, 0.5 ms per block. The embedded model (from its
    config.json) holds 4 layers x 3 KV heads x 32 dims x 4 bytes = 384 bytes per head-row,
    keys and values: 2 x 4 x 384 = 3072 bytes per token, 12288 per block of 4. A prompt of
    P tokens sends ceil((P - 1) / 4) blocks."""
    _, prompts = tiny
    cfg = json.loads((default_model_path() / "config.json").read_text())
    per_block = 2 * cfg["num_hidden_layers"] * 4 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    assert per_block == 12288
    ids = prompts[2]
    n = -(-(len(ids) - 1) // 4)
    expected = 0.002 + n * 0.0005 + n * per_block * 8 / 8e9
    clock = ManualClock()
    extra = {"link_bandwidth_gbps": 8.0, "link_latency_s": 0.002, "link_per_block_s": 0.0005}
    prefill = engine("kv_producer", "p-time", clock=clock, extra=extra)
    decode = engine("kv_consumer", "d-time", clock=clock, extra=extra)
    clock.now = 1.0
    prefill.add_request("r", {"prompt_token_ids": ids}, prefill_params())
    params = [o for o in prefill.step() if o.finished][0].kv_transfer_params  # t = 1.0
    decode.add_request("r", {"prompt_token_ids": ids}, decode_params(params, max_tokens=3))
    transfers = []
    decode.on_step.append(lambda rec: transfers.extend(rec.kv_connector_output.transfers))
    decode.step()  # t = 1.0: blocks allocated, copied; the step waits (clock jumps) to the end
    (t,) = transfers
    assert (t.num_blocks, t.num_bytes) == (n, n * per_block)
    assert t.start == 1.0 and t.end == pytest.approx(1.0 + expected, abs=1e-12)
    assert clock.now == pytest.approx(1.0 + expected, abs=1e-12)
    prefill.step()  # the producer learns its blocks were read at t.end: freed
    assert not prefill.scheduler.held_for_transfer and all_free(prefill)
    out = None
    while decode.has_unfinished_requests():
        out = decode.step() or out
    metrics = out[0].metrics
    assert metrics.first_token_time == pytest.approx(1.0 + expected, abs=1e-12)
    assert out[0].num_cached_tokens == len(ids) - 1
    assert all_free(decode)


def test_bad_config_and_params_name_the_field():
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig(kv_role="kv_sender")
    with pytest.raises(ValueError, match="kv_connector"):
        KVTransferConfig(kv_connector="NixlConnector")
    with pytest.raises(ValueError, match="link_bandwidth_gbps"):
        engine("kv_consumer", "d-bad", extra={"link_bandwidth_gbps": 0})
    with pytest.raises(ValueError, match="unknown keys"):
        engine("kv_consumer", "d-bad2", extra={"bandwidth": 1})
    decode = engine("kv_consumer", "d-bad3")
    with pytest.raises(ValueError, match="kv_transfer_params.remote_engine_id"):
        decode.add_request("r", "ROMEO:", decode_params({"do_remote_prefill": True, "remote_engine_id": 3}))
    assert not decode.has_unfinished_requests()
