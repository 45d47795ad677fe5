"""InputBatch, the runner's persistent batch: after every step of drawn runs (adds, aborts,
preemption, chunked prefill, prefix hits, speculative drafts accepted and rejected) its rows
hold exactly the scheduled requests' state, and its prepared inputs equal the from-scratch
``build_batch_inputs`` tensor for tensor."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.core.kv_cache_manager import KVCacheManager
from workbench.core.sched.output import ScheduledRequest, SchedulerOutput, SpecDecodeResult
from workbench.core.sched.scheduler import Scheduler
from workbench.request import Request
from workbench.sampling_params import SamplingParams
from workbench.worker.batch_inputs import BatchInputs, build_batch_inputs
from workbench.worker.input_batch import InputBatch
from workbench.worker.sampler import _is_plain_greedy

BLOCK_SIZE = 4
PREFIXES = ([11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26])  # shared: prefix hits
PARAMS = (
    SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, min_tokens=3,
                   stop_token_ids=[5]),
    SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.05, max_tokens=None,
                   ignore_eos=True),
    SamplingParams(temperature=0, logprobs=2, max_tokens=None, ignore_eos=True),
)
TENSORS = ("input_ids", "positions", "slot_mapping", "block_tables", "query_start_loc",
           "seq_lens", "logits_indices")


def assert_same_inputs(got: BatchInputs, want: BatchInputs) -> None:
    assert got.request_ids == want.request_ids
    assert got.sample_request_ids == want.sample_request_ids
    for name in TENSORS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype, name
        assert a.tolist() == b.tolist(), name


def assert_rows(batch: InputBatch, so: SchedulerOutput, requests) -> None:
    """Each scheduled request has a row holding its tokens, position, blocks and parameters."""
    assert sorted(batch.req_ids) == sorted(s.request_id for s in so.scheduled)
    assert batch.req_id_to_index == {rid: i for i, rid in enumerate(batch.req_ids)}
    for s in so.scheduled:
        row = batch.req_id_to_index[s.request_id]
        request = requests[s.request_id]
        tokens = request.all_token_ids[:s.num_computed_tokens] + list(s.token_ids)
        assert batch.num_tokens[row] == s.seq_len
        assert batch.token_ids[row, :s.seq_len].tolist() == tokens
        assert batch.num_computed_tokens[row] == s.num_computed_tokens
        table = batch.block_table[row]
        assert batch.num_blocks[row] == len(s.block_ids)
        assert table[:len(s.block_ids)].tolist() == list(s.block_ids)
        assert (table[len(s.block_ids):] == -1).all()
        sp = request.sampling_params
        assert (batch.temperature[row], batch.top_k[row], batch.top_p[row], batch.min_p[row]) == (
            np.float32(sp.temperature), sp.top_k, np.float32(sp.top_p), np.float32(sp.min_p))
    assert (batch.block_table[batch.num_reqs:] == -1).all()  # removed rows leave no blocks


ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 1), st.integers(1, 14), st.integers(0, 3)),
        st.tuples(st.just("abort"), st.integers(0, 99)),
        st.tuples(st.just("draft"), st.integers(0, 99), st.integers(1, 3), st.integers(0, 3)),
        st.tuples(st.just("step"),),
    ),
    min_size=5, max_size=60,
)


def run(actions, num_blocks: int, budget: int, table_width: int | None) -> dict[str, int]:
    """Drive a scheduler with a fake model through ``actions``, checking the persistent batch
    after every step; returns how often each situation under test came up."""
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=40)
    batch = InputBatch(BLOCK_SIZE, table_width, max_num_reqs=1, max_num_tokens=4)
    accepted: dict[str, int] = {}  # drafts the fake target accepts, per speculating request
    seen = dict(preempted=0, resumed=0, prefix_hit=0, chunked=0, spec=0, finished=0)
    count = 0
    for action in list(actions) + [("step",)] * 8:
        kind = action[0]
        if kind == "add":
            _, prefix, suffix, params = action
            prompt = PREFIXES[prefix] + [30 + (count * 7 + j) % 50 for j in range(suffix)]
            sched.add_request(Request(f"r{count}", prompt, PARAMS[params],
                                      arrival_time=float(count)))
            count += 1
        elif kind == "abort" and sched.requests:
            ids = sorted(sched.requests)
            sched.abort_request(ids[action[1] % len(ids)])
        elif kind == "draft" and sched.running:
            request = sched.running[action[1] % len(sched.running)]
            if request.num_computed_tokens == request.num_tokens - 1:  # decoding: may speculate
                request.spec_token_ids = [60 + j for j in range(action[2])]
                accepted[request.request_id] = min(action[3], action[2])
        elif kind == "step":
            so = sched.schedule()
            if so.scheduled:
                got = batch.prepare(so, sched.requests)
                assert_same_inputs(got, build_batch_inputs(so, BLOCK_SIZE, table_width))
            else:
                batch.update(so, sched.requests)
            assert_rows(batch, so, sched.requests)
            sample_ids = [s.request_id for s in so.scheduled if s.samples]
            if sample_ids:
                meta = batch.sampling_metadata(sample_ids, sched.requests)
                if meta.all_plain_greedy:
                    assert all(_is_plain_greedy(sched.requests[rid]) for rid in sample_ids)
                assert meta.temperature.tolist() == [
                    pytest.approx(sched.requests[rid].sampling_params.temperature)
                    for rid in sample_ids]
            spec = {s.request_id: SpecDecodeResult(s.spec_token_ids,
                                                   accepted.pop(s.request_id, 0))
                    for s in so.scheduled if s.spec_token_ids}
            sampled = {s.request_id: 40 + (so.step + len(s.request_id)) % 9
                       for s in so.scheduled if s.samples}
            seen["preempted"] += len(so.preempted_request_ids)
            seen["resumed"] += len(so.resumed_request_ids)
            seen["finished"] += len(so.finished_request_ids)
            seen["prefix_hit"] += sum(s.num_cached_tokens > 0 for s in so.scheduled)
            seen["chunked"] += sum(s.is_prefill and not s.samples for s in so.scheduled)
            seen["spec"] += len(spec)
            sched.update_from_output(so, sampled, spec_decode=spec)
    return seen


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(actions=ACTIONS, num_blocks=st.integers(10, 24), budget=st.integers(3, 24),
       table_width=st.sampled_from([None, 12]))
def test_rows_equal_a_rebuild_after_every_step(actions, num_blocks, budget, table_width):
    run(actions, num_blocks, budget, table_width)


def test_the_drawn_situations_come_up():
    """One fixed run through the same checks meets every situation the drawn runs may:
    preemption and resumption, prefix hits, chunked prefill, drafts, aborts."""
    add = [("add", i % 2, 6 + i, i % 4) for i in range(6)]
    actions = add[:3] + [("step",)] * 3 + [("draft", 0, 3, 1), ("draft", 1, 2, 0)] + [
        ("step",)] * 2 + add[3:] + [("step",)] * 6 + [("abort", 1), ("step",)] * 2
    seen = run(actions, num_blocks=10, budget=6, table_width=None)
    assert all(seen.values()), seen


def _chunk(rid, start, tokens, blocks, samples=True):
    return ScheduledRequest(rid, start, len(tokens), tuple(tokens), tuple(blocks),
                            is_prefill=len(tokens) > 1, samples=samples)


def _request(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(temperature=0, max_tokens=None))


def test_a_running_row_takes_only_its_new_block_and_rows_condense_on_removal():
    batch = InputBatch(4, max_num_reqs=1, max_num_tokens=4)
    requests = {"a": _request("a", [1, 2, 3, 4]), "b": _request("b", [5, 6]),
                "c": _request("c", [7, 8, 9])}
    so = SchedulerOutput(step=0, new_request_ids=("a", "b", "c"), scheduled=(
        _chunk("a", 0, [1, 2, 3, 4], [10]), _chunk("b", 0, [5, 6], [11]),
        _chunk("c", 0, [7, 8, 9], [12])))
    batch.prepare(so, requests)
    assert batch.req_ids == ["a", "b", "c"]
    # "a" decodes into a new block; "b" finished; "c" decodes in its block
    so = SchedulerOutput(step=1, finished_request_ids=("b",), scheduled=(
        _chunk("a", 4, [50], [10, 13]), _chunk("c", 3, [51], [12])))
    got = batch.prepare(so, requests)
    assert batch.req_ids == ["a", "c"]  # "c" moved into "b"'s row
    assert batch.block_table[:3, :2].tolist() == [[10, 13], [12, -1], [-1, -1]]
    assert batch.token_ids[1, :4].tolist() == [7, 8, 9, 51]
    assert got.slot_mapping.tolist() == [13 * 4 + 0, 12 * 4 + 3]
    assert got.positions.tolist() == [4, 3]
    # "a" preempted; a request not scheduled this step leaves the batch too
    so = SchedulerOutput(step=2, preempted_request_ids=("a",), scheduled=())
    batch.update(so, requests)
    assert batch.req_ids == [] and (batch.block_table == -1).all()


def test_a_row_rolled_back_by_rejected_drafts_rewrites_from_the_chunk():
    """A speculating step writes k + 1 tokens; with drafts rejected the next chunk starts
    earlier, and the row's tokens from there are the new chunk's."""
    batch = InputBatch(4)
    requests = {"a": _request("a", [1, 2, 3])}
    batch.prepare(SchedulerOutput(step=0, new_request_ids=("a",), scheduled=(
        _chunk("a", 0, [1, 2, 3], [0]),)), requests)
    so = SchedulerOutput(step=1, scheduled=(ScheduledRequest(
        "a", 3, 3, (9, 60, 61), (0, 1), is_prefill=True, samples=True, spec_token_ids=(60, 61)),))
    got = batch.prepare(so, requests)
    assert got.logits_indices.tolist() == [0, 1, 2]
    assert batch.token_ids[0, :6].tolist() == [1, 2, 3, 9, 60, 61]
    # one draft accepted (60), the target's token 70 follows it; block 1 is kept
    got = batch.prepare(SchedulerOutput(step=2, scheduled=(_chunk("a", 5, [70], [0, 1]),)),
                        requests)
    assert batch.token_ids[0, :6].tolist() == [1, 2, 3, 9, 60, 70]
    assert got.slot_mapping.tolist() == [1 * 4 + 1]


def test_sampling_metadata_holds_the_rows_parameters():
    batch = InputBatch(4)
    greedy = Request("g", [1, 2], SamplingParams(temperature=0, max_tokens=None))
    random = Request("t", [3], SamplingParams(temperature=0.5, top_k=7, top_p=0.8, min_p=0.1))
    requests = {"g": greedy, "t": random}
    batch.prepare(SchedulerOutput(step=0, scheduled=(_chunk("g", 0, [1, 2], [0]),
                                                     _chunk("t", 0, [3], [1]))), requests)
    meta = batch.sampling_metadata(("t", "g"), requests)
    assert not meta.all_plain_greedy
    assert meta.top_k.tolist() == [7, 0]
    assert torch.allclose(meta.temperature, torch.tensor([0.5, 0.0]))
    assert torch.allclose(meta.top_p, torch.tensor([0.8, 1.0]))
    assert torch.allclose(meta.min_p, torch.tensor([0.1, 0.0]))
    batch.update(SchedulerOutput(step=1, finished_request_ids=("t",), scheduled=(
        _chunk("g", 2, [5], [0]),)), requests)
    assert batch.sampling_metadata(("g",), requests).all_plain_greedy


def test_a_finished_id_used_again_gets_a_fresh_row():
    """vLLM's order: finished rows go first, so a new request under a finished one's id (both
    in one SchedulerOutput) does not inherit its row."""
    batch = InputBatch(4)
    old = Request("a", [1, 2, 3], SamplingParams(temperature=0.5, max_tokens=None))
    batch.prepare(SchedulerOutput(step=0, new_request_ids=("a",), scheduled=(
        _chunk("a", 0, [1, 2, 3], [0]),)), {"a": old})
    new = Request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=None))
    so = SchedulerOutput(step=1, finished_request_ids=("a",), new_request_ids=("a",), scheduled=(
        ScheduledRequest("a", 3, 2, (4, 5), (0, 2), is_prefill=True, samples=True,
                         num_cached_tokens=3),))
    batch.prepare(so, {"a": new})
    assert batch.temperature[0] == 0.0
    assert batch.sampling_metadata(("a",), {"a": new}).all_plain_greedy
