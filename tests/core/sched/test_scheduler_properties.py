"""Property tests: random workloads run to completion with a fake runner.

Checked against rules stated here, independently of the scheduler's code:
* add_request rejects exactly the requests that could never finish;
* every step respects the token budget and max_num_seqs, and each chunk carries the
  request's own tokens, a block table of ceil(seq_len / block_size) blocks, and samples
  iff it reaches the last known token;
* after every step each running request's blocks hold exactly its computed tokens
  (shared prefix blocks included), and the scheduler's and KV cache's invariants hold;
* every request ends with exactly min(max_tokens, max_model_len - prompt) outputs -- the
  runner's tokens, in order, whatever preemptions happened -- or is aborted;
* at the end no block is leaked: every block is free.
"""

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from workbench.core.kv_cache_manager import KVCacheManager, cdiv
from workbench.core.sched.scheduler import Scheduler
from workbench.request import Request, RequestStatus
from workbench.sampling_params import SamplingParams

BASE = list(range(1, 41))  # a shared prefix family, so prompts often hit the prefix cache


def runner_token(request_index: int, output_index: int) -> int:
    """The fake runner: a token determined by the request and the output position."""
    return (3 * request_index + output_index) % 5


request_st = st.tuples(
    st.integers(0, 12),  # arrival step
    st.integers(0, 16),  # length of the shared prefix taken from BASE
    st.lists(st.integers(0, 3), max_size=8),  # private suffix
    st.integers(1, 12),  # max_tokens
    st.integers(0, 3),  # priority
    st.one_of(st.none(), st.tuples(st.integers(0, 20), st.booleans())),  # abort (step, mid-step)
)

config_st = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4, 8]),
    "pool_tokens": st.integers(8, 64),  # num_blocks = max(1, pool_tokens // block_size)
    "budget": st.integers(2, 32),
    "max_num_seqs": st.integers(1, 6),
    "max_model_len": st.integers(8, 64),
    "chunked": st.booleans(),
    "caching": st.booleans(),
    "policy": st.sampled_from(["fcfs", "priority", "spf"]),
}).map(lambda c: {**c, "num_blocks": max(1, c["pool_tokens"] // c["block_size"])})


def should_reject(cfg, prompt_len: int, max_tokens: int) -> bool:
    """The request could never finish: too long for the model, for one step without
    chunking, or its largest K/V footprint exceeds the pool."""
    if prompt_len >= cfg["max_model_len"]:
        return True
    if not cfg["chunked"] and prompt_len > cfg["budget"]:
        return True
    final_len = min(prompt_len + max_tokens, cfg["max_model_len"])
    return cdiv(final_len - 1, cfg["block_size"]) > cfg["num_blocks"]


def check_step(s, out, cfg):
    assert out.total_num_scheduled_tokens <= cfg["budget"]
    assert len(out.scheduled) <= cfg["max_num_seqs"]
    assert len({c.request_id for c in out.scheduled}) == len(out.scheduled)
    for c in out.scheduled:
        r = s.requests[c.request_id]
        assert c.num_new_tokens >= 1
        assert list(c.token_ids) == r.all_token_ids[c.num_computed_tokens : c.seq_len]
        assert len(c.block_ids) == cdiv(c.seq_len, cfg["block_size"])
        assert c.samples == (c.seq_len == r.num_tokens)
        assert c.is_prefill == (c.num_new_tokens > 1 or c.num_computed_tokens < r.num_prompt_tokens)


def check_block_contents(s, bs):
    """Each running request's blocks hold exactly its computed tokens, in order."""
    kv = s.kv_cache
    for r in s.running:
        tokens = r.all_token_ids[: r.num_computed_tokens]
        for i, block_id in enumerate(kv.block_table(r.request_id)):
            assert kv.blocks[block_id].token_ids == tuple(tokens[i * bs : (i + 1) * bs]), (
                f"{r.request_id}: block {block_id} at position {i}"
            )


# Memory pressure: a small pool, several sequences at once, early arrivals -> preemptions.
pressure_config_st = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4]),
    "pool_tokens": st.integers(12, 28),
    "budget": st.integers(8, 32),
    "max_num_seqs": st.integers(3, 6),
    "max_model_len": st.just(64),
    "chunked": st.booleans(),
    "caching": st.booleans(),
    "policy": st.sampled_from(["fcfs", "priority", "spf"]),
}).map(lambda c: {**c, "num_blocks": c["pool_tokens"] // c["block_size"]})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, specs=st.lists(request_st, min_size=2, max_size=10))
def test_random_workloads_run_to_completion(cfg, specs):
    run_workload(cfg, specs)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=pressure_config_st, specs=st.lists(request_st, min_size=3, max_size=8))
def test_workloads_under_memory_pressure(cfg, specs):
    specs = [(arrival % 3, *rest) for arrival, *rest in specs]
    run_workload(cfg, specs)


def run_workload(cfg, specs):
    kv = KVCacheManager(cfg["num_blocks"], cfg["block_size"], enable_prefix_caching=cfg["caching"])
    s = Scheduler(kv, max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["budget"],
                  max_model_len=cfg["max_model_len"], enable_chunked_prefill=cfg["chunked"],
                  policy=cfg["policy"])
    accepted: dict[str, tuple[int, Request, int]] = {}  # id -> (index, request, expected outputs)
    aborted: set[str] = set()
    arrivals = sorted(range(len(specs)), key=lambda i: (specs[i][0], i))
    max_steps = 3000
    step = 0
    while step < max_steps:
        for i in arrivals:
            arrival, prefix, suffix, max_tokens, priority, _ = specs[i]
            if arrival != step:
                continue
            prompt = BASE[:prefix] + suffix or [0]
            r = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                        priority=priority, arrival_time=float(i))
            try:
                s.add_request(r)
            except ValueError:
                assert should_reject(cfg, len(prompt), max_tokens), f"r{i} wrongly rejected"
                continue
            assert not should_reject(cfg, len(prompt), max_tokens), f"r{i} wrongly accepted"
            expected = min(max_tokens, cfg["max_model_len"] - len(prompt))
            accepted[r.request_id] = (i, r, expected)
        aborts_now = [(f"r{i}", spec[5][1]) for i, spec in enumerate(specs)
                      if spec[5] is not None and spec[5][0] == step]
        for rid, mid in aborts_now:
            if not mid and rid in s.requests:
                s.abort_request(rid)
                aborted.add(rid)
        if step > max(spec[0] for spec in specs) and not s.has_unfinished_requests():
            break
        out = s.schedule()
        s.check_invariants(out)
        check_step(s, out, cfg)
        for rid, mid in aborts_now:
            if mid and rid in s.requests:
                s.abort_request(rid)
                aborted.add(rid)
        sampled = {c.request_id: runner_token(accepted[c.request_id][0], accepted[c.request_id][1].num_output_tokens)
                   for c in out.scheduled if c.samples}
        got = s.update_from_output(out, sampled)
        assert [r.request_id for r in got] == [c.request_id for c in out.scheduled
                                               if c.samples and c.request_id not in aborted]
        s.check_invariants()
        check_block_contents(s, cfg["block_size"])
        step += 1
    assert step < max_steps, "the workload did not finish (livelock?)"

    for rid, (i, r, expected) in accepted.items():
        if rid in aborted:
            assert r.status is RequestStatus.FINISHED_ABORTED
            assert r.num_output_tokens <= expected
        else:
            assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED, (rid, r.status)
            assert r.output_token_ids == [runner_token(i, k) for k in range(expected)]
    assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0
    assert all(b.ref_count == 0 and not b.owners for b in kv.blocks)
    kv.check_invariants([])
    assert not s.running and not s.waiting and not s.requests
    event(f"accepted {min(len(accepted), 5)}+")
    event("preempted" if any(r.num_preemptions for _, r, _ in accepted.values()) else "no preemption")
    event("prefix hit" if kv.prefix_cache_stats.hits else "no prefix hit")
    event("aborted" if aborted else "no abort")
