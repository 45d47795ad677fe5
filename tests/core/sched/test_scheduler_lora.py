"""The scheduler with LoRA adapters: at most ``max_loras`` distinct adapters per batch (a
waiting request whose adapter would exceed it is passed over, keeping its place, as vLLM
does), and a prefix cache keyed by adapter (no block is ever shared across adapters).

Hand-worked schedules, then hypothesis workloads mixing adapters under memory pressure,
with a fake runner.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.core.kv_cache_manager import KVCacheManager
from workbench.core.kv_cache_utils import hash_request_blocks
from workbench.core.sched.scheduler import Scheduler
from workbench.lora.request import LoRARequest
from workbench.request import Request
from workbench.sampling_params import SamplingParams

LORAS = {name: LoRARequest(name, i + 1, f"/adapters/{name}") for i, name in enumerate("xyz")}


def request(rid, prompt, lora=None, max_tokens=2):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   lora_request=None if lora is None else LORAS[lora])


def scheduler(max_loras=1, num_blocks=64, block_size=4, budget=64, max_num_seqs=8):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=128, max_loras=max_loras)


def step(s):
    out = s.schedule()
    s.update_from_output(out, {c.request_id: 7 for c in out.scheduled if c.samples})
    s.check_invariants()
    return out


def test_a_request_whose_adapter_would_exceed_max_loras_is_skipped_not_blocking():
    s = scheduler(max_loras=1)
    for rid, lora in (("a", "x"), ("b", "y"), ("c", "x"), ("d", None), ("e", "y")):
        s.add_request(request(rid, range(1, 6), lora))
    out = step(s)
    # a brings x; b (y) and e (y) would be a second adapter; c shares x; d has none.
    assert [c.request_id for c in out.scheduled] == ["a", "c", "d"]
    assert out.lora_skipped_request_ids == ("b", "e") and out.lora_names == ("x",)
    assert [r.request_id for r in s.waiting] == ["b", "e"]  # their places kept
    assert "skipped_max_loras=['b', 'e']" in repr(out) and "a: prefill [0, 5) lora=x" in repr(out)
    out = step(s)  # a, c, d decode and finish (max_tokens=2): x still in the batch
    assert out.lora_skipped_request_ids == ("b", "e")
    out = step(s)
    assert [c.request_id for c in out.scheduled] == ["b", "e"] and out.lora_names == ("y",)


def test_max_loras_two_admits_two_adapters():
    s = scheduler(max_loras=2)
    for rid, lora in (("a", "x"), ("b", "y"), ("c", "z"), ("d", "x")):
        s.add_request(request(rid, range(1, 6), lora))
    out = step(s)
    assert [c.request_id for c in out.scheduled] == ["a", "b", "d"]
    assert out.lora_skipped_request_ids == ("c",)


def test_identical_prompts_under_two_adapters_share_no_block():
    s = scheduler(max_loras=2)
    prompt = list(range(1, 14))  # 3 full blocks
    s.add_request(request("x1", prompt, "x"))
    while s.has_unfinished_requests():
        step(s)
    for rid, lora, hit in (("y1", "y", 0), ("base", None, 0), ("x2", "x", 12)):
        s.add_request(request(rid, prompt, lora))
        out = step(s)
        assert out.scheduled[0].num_cached_tokens == hit, rid
        while s.has_unfinished_requests():
            step(s)
    hashes = {lora: hash_request_blocks(prompt, 4, lora_name=lora) for lora in ("x", "y", None)}
    assert len({h for hs in hashes.values() for h in hs}) == 9
    # an adapter's name as a salt is another key: the key count enters the hash
    assert not set(hash_request_blocks(prompt, 4, cache_salt="x")) & set(hashes["x"])


adapter_st = st.sampled_from([None, "x", "y", "z"])
request_st = st.tuples(st.integers(0, 6), st.integers(0, 12), st.lists(st.integers(0, 3), max_size=6),
                       st.integers(1, 8), adapter_st)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize=True)
@given(max_loras=st.integers(1, 3), block_size=st.sampled_from([1, 2, 4]),
       pool_tokens=st.integers(16, 40), budget=st.integers(4, 24), max_num_seqs=st.integers(2, 6),
       specs=st.lists(request_st, min_size=2, max_size=10))
def test_mixed_adapter_workloads_keep_the_invariants(max_loras, block_size, pool_tokens, budget,
                                                     max_num_seqs, specs):
    s = scheduler(max_loras, pool_tokens // block_size, block_size, budget, max_num_seqs)
    shared = list(range(100, 112))
    pending = sorted(range(len(specs)), key=lambda i: specs[i][0])
    owners: dict[str, str | None] = {}
    for step_index in range(400):
        while pending and specs[pending[0]][0] <= step_index:
            i = pending.pop(0)
            _, n_shared, suffix, max_tokens, lora = specs[i]
            r = request(f"r{i}", shared[:n_shared] + suffix + [1], lora, max_tokens)
            try:
                s.add_request(r)
                owners[r.request_id] = lora
            except ValueError:
                pass  # could never fit the pool
        if not pending and not s.has_unfinished_requests():
            break
        out = step(s)
        assert len(out.lora_names) <= max_loras
        for rid in out.lora_skipped_request_ids:
            assert owners[rid] not in out.lora_names and len(out.lora_names) == max_loras
        holders: dict[int, set] = {}
        for r in s.running:
            for block_id in s.kv_cache.block_table(r.request_id):
                holders.setdefault(block_id, set()).add(owners[r.request_id])
        assert all(len(v) == 1 for v in holders.values()), "a block shared across adapters"
    assert not s.has_unfinished_requests() and not pending
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks
