"""Speculative decoding in the scheduler, with a fake proposer and a fake verifier.

The fake target emits a fixed token per (request, output position); the fake proposer drafts
k tokens, each right or wrong by a hypothesis-drawn pattern; the verifier accepts the leading
right ones and emits the target's token after them (exactly what greedy verification does).
Checked against rules stated here, not the scheduler's code:
* every request ends with exactly the tokens plain decoding gives (the target's, up to
  max_tokens / max_model_len / its first eos), whatever drafts, preemptions, prefix hits and
  aborts happened; nothing after a stop is appended;
* each step's drafts sit after the request's last known token, count in the token budget,
  and never push a request past max_tokens or max_model_len;
* after every step each running request's blocks hold exactly its computed (accepted)
  tokens, its table has ceil(computed / block_size) blocks (the rejected drafts' blocks went
  back), no cached block holds a rejected draft, and no block is leaked at the end.
"""

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from workbench.core.kv_cache_manager import KVCacheManager, cdiv
from workbench.core.sched.output import SpecDecodeResult
from workbench.core.sched.scheduler import Scheduler
from workbench.request import Request, RequestStatus
from workbench.sampling_params import SamplingParams

BASE = list(range(10, 50))
EOS = 4


def target_token(i: int, j: int) -> int:
    """The fake target's token at output position j of request i (EOS = 4 appears)."""
    return (3 * i + 2 * j + j // 3) % 7


def check_block_contents(s, bs):
    kv = s.kv_cache
    for r in s.running:
        tokens = r.all_token_ids[: r.num_computed_tokens]
        table = kv.block_table(r.request_id)
        assert len(table) == cdiv(r.num_computed_tokens, bs)
        for i, block_id in enumerate(table):
            assert kv.blocks[block_id].token_ids == tuple(tokens[i * bs : (i + 1) * bs])


request_st = st.tuples(
    st.integers(0, 8),  # arrival step
    st.integers(0, 12),  # shared prefix length
    st.lists(st.integers(0, 6), max_size=6),  # private suffix
    st.integers(1, 14),  # max_tokens
    st.booleans(),  # stops at eos
    st.one_of(st.none(), st.integers(0, 25)),  # abort step
)
config_st = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4]),
    "pool_tokens": st.integers(16, 48),
    "budget": st.integers(4, 24),
    "max_num_seqs": st.integers(1, 5),
    "max_model_len": st.integers(12, 48),
    "caching": st.booleans(),
    "k": st.integers(1, 6),
    "policy": st.sampled_from(["fcfs", "priority"]),
}).map(lambda c: {**c, "num_blocks": c["pool_tokens"] // c["block_size"]})


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, specs=st.lists(request_st, min_size=1, max_size=7),
       pattern=st.lists(st.booleans(), min_size=1, max_size=40))
def test_speculating_workloads_emit_exactly_the_targets_tokens(cfg, specs, pattern):
    kv = KVCacheManager(cfg["num_blocks"], cfg["block_size"], enable_prefix_caching=cfg["caching"])
    s = Scheduler(kv, max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["budget"],
                  max_model_len=cfg["max_model_len"], policy=cfg["policy"])
    accepted: dict[str, tuple[int, Request, list[int]]] = {}
    aborted: set[str] = set()
    n_drafts = n_accepted = 0
    flip = 0
    for step in range(2000):
        for i, (arrival, prefix, suffix, max_tokens, stops, _) in enumerate(specs):
            if arrival != step:
                continue
            prompt = BASE[:prefix] + suffix or [0]
            r = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=not stops),
                        eos_token_id=EOS, arrival_time=float(i))
            try:
                s.add_request(r)
            except ValueError:
                continue
            n = min(max_tokens, cfg["max_model_len"] - len(prompt))
            want = [target_token(i, j) for j in range(n)]
            if stops and EOS in want:
                want = want[: want.index(EOS) + 1]
            accepted[r.request_id] = (i, r, want)
        for i, spec in enumerate(specs):
            if spec[5] == step and f"r{i}" in s.requests:
                s.abort_request(f"r{i}")
                aborted.add(f"r{i}")
        if step > max(sp[0] for sp in specs) and not s.has_unfinished_requests():
            break
        out = s.schedule()
        s.check_invariants(out)
        assert out.total_num_scheduled_tokens <= cfg["budget"]
        results, sampled = {}, {}
        for c in out.scheduled:
            r = s.requests[c.request_id]
            k = len(c.spec_token_ids)
            assert list(c.token_ids) == r.all_token_ids[c.num_computed_tokens : c.seq_len - k] + list(c.spec_token_ids)
            assert len(c.block_ids) == cdiv(c.seq_len, cfg["block_size"])
            if not c.samples:
                assert k == 0
                continue
            assert c.seq_len - k == r.num_tokens
            assert r.num_output_tokens + k + 1 <= r.sampling_params.max_tokens
            assert r.num_tokens + k + 1 <= cfg["max_model_len"]
            i = accepted[c.request_id][0]
            truth = [target_token(i, r.num_output_tokens + j) for j in range(k + 1)]
            a = 0
            while a < k and c.spec_token_ids[a] == truth[a]:
                a += 1
            results[c.request_id] = SpecDecodeResult(c.spec_token_ids, a)
            sampled[c.request_id] = truth[a]
            n_drafts += k
            n_accepted += a
        got = s.update_from_output(out, sampled, spec_decode=results)
        s.check_invariants()
        check_block_contents(s, cfg["block_size"])
        drafts = {}
        for r in got:  # the fake proposer: right or wrong by the drawn pattern
            if r.is_finished:
                continue
            i = accepted[r.request_id][0]
            d = []
            for j in range(cfg["k"]):
                right = pattern[flip % len(pattern)]
                flip += 1
                t = target_token(i, r.num_output_tokens + j)
                d.append(t if right else (t + 1) % 7)
            drafts[r.request_id] = d
        s.update_draft_token_ids(drafts)
        s.check_invariants()
    else:
        raise AssertionError("the workload did not finish")
    for rid, (i, r, want) in accepted.items():
        if rid in aborted:
            assert r.status is RequestStatus.FINISHED_ABORTED
            assert r.output_token_ids == want[: r.num_output_tokens]
        else:
            assert r.output_token_ids == want, rid
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_invariants([])
    event("drafts accepted" if n_accepted else "no draft accepted")
    event("drafts rejected" if n_drafts > n_accepted else "no draft rejected")
    event("preempted" if any(r.num_preemptions for _, r, _ in accepted.values()) else "no preemption")
    event("prefix hit" if kv.prefix_cache_stats.hits else "no prefix hit")


def test_rejected_drafts_blocks_go_back_and_budget_counts_drafts():
    """block_size 4, prompt of 6 tokens [100..105], k = 5 drafts, budget 8."""
    kv = KVCacheManager(8, 4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    r = Request("A", list(range(100, 106)), SamplingParams(max_tokens=20, ignore_eos=True))
    s.add_request(r)
    out = s.schedule()  # prefill 6 tokens: blocks 0, 1
    assert [(c.num_new_tokens, c.block_ids) for c in out.scheduled] == [(6, (0, 1))]
    s.update_from_output(out, {"A": 7})  # 7 tokens known, 6 computed
    s.update_draft_token_ids({"A": [1, 2, 3, 4, 5]})
    out = s.schedule()
    c, = out.scheduled
    # last known token + 5 drafts = 6 tokens at positions 6..11: 12 slots, 3 blocks (0, 1, 2)
    assert (c.num_computed_tokens, c.num_new_tokens, c.token_ids, c.block_ids) == (6, 6, (7, 1, 2, 3, 4, 5), (0, 1, 2))
    assert out.scheduled_spec_decode_tokens == {"A": (1, 2, 3, 4, 5)} and not c.is_prefill
    assert r.spec_token_ids == []  # consumed by the schedule
    s.check_invariants(out)
    # one draft accepted: computed = 6 + 1 (token 7) + 1 (draft 1) = 8; tokens 7, 1 and then 9
    s.update_from_output(out, {"A": 9}, spec_decode={"A": SpecDecodeResult((1, 2, 3, 4, 5), 1)})
    assert r.output_token_ids == [7, 1, 9] and r.num_computed_tokens == 8
    assert kv.block_table("A") == [0, 1]  # block 2 held only rejected drafts: freed
    assert kv.blocks[2].ref_count == 0 and kv.blocks[2].block_hash is None
    assert kv.blocks[1].token_ids == (104, 105, 7, 1) and kv.blocks[1].block_hash is not None
    s.check_invariants()
    # budget 8 with 1 known token to compute leaves 7 for drafts; max_tokens 20 - 3 outputs - 1
    s.update_draft_token_ids({"A": list(range(20, 30))})
    out = s.schedule()
    assert out.scheduled[0].spec_token_ids == tuple(range(20, 27))
    assert out.total_num_scheduled_tokens == 8


def test_drafts_are_dropped_before_anyone_is_preempted():
    """block_size 2, 4 blocks; A (3 tokens) and B (3 tokens) each hold 2 blocks after
    prefill; A's drafts (2 of 3 fit max_tokens 4) would need a third block: they are
    dropped, nobody is preempted."""
    kv = KVCacheManager(4, 2)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32)
    a = Request("A", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    b = Request("B", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.update_from_output(out, {"A": 4, "B": 8})  # each: 4 known, 3 computed, 2 blocks
    s.update_draft_token_ids({"A": [9, 9, 9]})
    out = s.schedule()
    assert not out.preempted_request_ids and not out.scheduled_spec_decode_tokens
    assert [(c.request_id, c.num_new_tokens) for c in out.scheduled] == [("A", 1), ("B", 1)]
    s.check_invariants(out)


def test_drafts_for_a_request_part_way_through_its_prompt_are_dropped():
    """vLLM's update_draft_token_ids ignores drafts handed to a request whose last chunk did
    not reach its last known token (is_prefill_chunk). Prompt of 10 tokens, budget 6: the
    first chunk computes 6 and samples nothing; drafts then are dropped, so the next chunk is
    the 4 remaining prompt tokens alone. Once it has sampled, drafts are kept again."""
    kv = KVCacheManager(16, 4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=6, max_model_len=64)
    r = Request("A", list(range(100, 110)), SamplingParams(max_tokens=20, ignore_eos=True))
    s.add_request(r)
    out = s.schedule()
    assert [(c.num_new_tokens, c.samples) for c in out.scheduled] == [(6, False)]
    s.update_from_output(out, {})
    s.update_draft_token_ids({"A": [1, 2, 3]})
    assert r.spec_token_ids == []
    out = s.schedule()
    (c,) = out.scheduled
    assert (c.num_new_tokens, c.spec_token_ids, c.samples) == (4, (), True)
    s.update_from_output(out, {"A": 7})
    s.update_draft_token_ids({"A": [1, 2, 3]})  # a decoding request keeps its drafts
    out = s.schedule()
    assert out.scheduled[0].spec_token_ids == (1, 2, 3)
    s.check_invariants(out)


def test_drafts_are_dropped_when_the_chunk_stops_one_token_short():
    """The chunk stops one token before the prompt's end (6 of 7 computed: as many as right
    after a sampled token), yet it sampled nothing: vLLM still counts it a prefill chunk."""
    kv = KVCacheManager(16, 4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=6, max_model_len=64)
    r = Request("A", list(range(100, 107)), SamplingParams(max_tokens=20, ignore_eos=True))
    s.add_request(r)
    s.update_from_output(s.schedule(), {})
    assert r.num_computed_tokens == r.num_tokens - 1
    s.update_draft_token_ids({"A": [1, 2]})
    (c,) = s.schedule().scheduled
    assert (c.num_new_tokens, c.spec_token_ids) == (1, ())
