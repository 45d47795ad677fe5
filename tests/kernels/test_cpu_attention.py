"""The "cpu" attention backend against the torch reference (fp32/fp16/bf16, NaN-poisoned caches).

``build_batch`` (workbench/benchmarks/checks.py, shared with ``workbench selftest``) fills every cache slot the kernel must not read with NaN
and shuffles the block tables, so a read past a length or an unwritten output fails.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_triton_kernels import SETTINGS, attention_cases

from workbench.kernels import ops
from workbench.benchmarks.checks import (attention_batches, build_batch, check_paged_attention,
                                         check_write_kv_cache)
from workbench.kernels import cpu_attention, cpu_few_tokens_attention, cpu_rope_kv, reference


def check_cpu(batch, **kw):
    check_paged_attention(batch, backend="cpu", **kw)


PATHS = ["batched", "few-tokens"]


@contextlib.contextmanager
def attention_path(name):
    """Steps take the batched path ("batched") or the few-tokens kernel ("few-tokens") whatever
    their number of query tokens, while inside."""
    module = cpu_few_tokens_attention
    before = module.MAX_QUERY_TOKENS, module.MAX_POSITIONS
    module.MAX_QUERY_TOKENS = module.MAX_POSITIONS = 0 if name == "batched" else 1 << 30
    try:
        yield
    finally:
        module.MAX_QUERY_TOKENS, module.MAX_POSITIONS = before


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sliding_window", [None, 48])
@pytest.mark.parametrize("kind", sorted(attention_batches(40, 70)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selftest_batches(kind, sliding_window, dtype, path):
    """The batches ``workbench selftest`` checks, at its ``--small`` sizes."""
    q_lens, ctx_lens = attention_batches(40, 70)[kind]
    with attention_path(path):
        check_cpu(build_batch(q_lens, ctx_lens, num_kv_heads=3, group=2, head_dim=32,
                              block_size=16, dtype=dtype, seed=len(kind)),
                  sliding_window=sliding_window)


@settings(max_examples=60, **SETTINGS)
@given(case=attention_cases(max_seqs=6, max_q=40, max_ctx=200),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       sliding_window=st.one_of(st.none(), st.integers(1, 70)),
       softcap=st.one_of(st.none(), st.floats(2.0, 30.0)), path=st.sampled_from(PATHS))
def test_cpu_backend_matches_reference(case, dtype, sliding_window, softcap, path):
    with attention_path(path):
        check_cpu(build_batch(**{**case, "dtype": dtype}), sliding_window=sliding_window,
                  softcap=softcap)


@settings(max_examples=20, **SETTINGS)
@given(ctx=st.lists(st.integers(0, 400), min_size=2, max_size=40),
       block_size=st.sampled_from([1, 16, 32]), seed=st.integers(0, 2**16))
def test_many_decodes_of_spread_lengths(ctx, block_size, seed):
    """All-decode steps, where sequences are cut into length tiles; one plan, two layers'
    worth of calls (with and without a window), as the model reuses it."""
    with attention_path("batched"):
        batch = build_batch([1] * len(ctx), ctx, num_kv_heads=2, group=3, head_dim=32,
                            block_size=block_size, dtype=torch.float32, seed=seed)
        _, _, _, block_tables, qsl, seq_lens = batch
        plan = ops.plan_attention(block_tables, qsl, seq_lens, block_size, backend="cpu")
        assert [(g.start, g.end) for g in plan.decode_groups] == list(
            zip([0] + [g.end for g in plan.decode_groups[:-1]], [g.end for g in plan.decode_groups]))
        assert plan.decode_groups[-1].end == len(ctx)
        check_cpu(batch, plan=plan)
        check_cpu(batch, plan=plan, sliding_window=50)


@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("sliding_window", [None, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_chunks_match_reference(group, sliding_window, dtype):
    """Speculative verify chunks (2..SHORT_CHUNK query tokens after a context: K/V unrepeated,
    ``enable_gqa``), a whole short prompt (plain causal), a chunk one token longer than
    SHORT_CHUNK (K/V repeated) and a decode in one batch, under one plan."""
    with attention_path("batched"):
        n = cpu_attention.SHORT_CHUNK
        q_lens, ctx_lens = [2, 5, n, n, n + 1, 1], [40, 17, 3, 0, 30, 25]
        batch = build_batch(q_lens, ctx_lens, num_kv_heads=2, group=group, head_dim=32,
                            block_size=16, dtype=dtype, seed=group)
        plan = ops.plan_attention(*batch[3:], 16, backend="cpu")
        assert [p.q_end - p.q_start for p in plan.prefills] == [2, 5, n, n, n + 1]
        check_cpu(batch, plan=plan, sliding_window=sliding_window)


def test_short_chunk_mask_is_the_bottom_right_causal_rule():
    """A short chunk's mask (zeros and the cached triangle) is the rule's: query ``i`` of a
    ``q_len``-token chunk ending a ``seq_len``-token sequence sees keys ``0..seq_len - q_len + i``."""
    for q_len, seq_len in [(2, 2), (2, 9), (5, 5), (5, 37), (cpu_attention.SHORT_CHUNK, 40)]:
        chunk = cpu_attention.PrefillChunk(0, q_len, seq_len, torch.arange(seq_len))
        mask = cpu_attention._prefill_mask(chunk, None)
        visible = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
        assert torch.equal(mask == 0, visible) and bool(torch.isneginf(mask[~visible]).all())
        assert cpu_attention._prefill_mask(chunk, None) is mask  # built once per plan


def test_length_tiles_cut_padding():
    """Sequences of 1 and 20 blocks are not padded to one length: sorted, cut into tiles of at
    most tile_rows() positions (a longer sequence alone), each as long as its longest sequence."""
    with attention_path("batched"):
        lens = [16] * 10 + [320] * 10
        batch = build_batch([1] * 20, [n - 1 for n in lens], num_kv_heads=1, group=1, head_dim=32,
                            block_size=16, dtype=torch.float32, seed=0)
        _, _, _, block_tables, qsl, seq_lens = batch
        plan = cpu_attention.plan_attention(block_tables, qsl, seq_lens, 16)
        per_tile = cpu_attention.tile_rows() // 320
        long_tiles = [(per_tile, 320)] * (10 // per_tile) + ([(10 % per_tile, 320)] if 10 % per_tile else [])
        assert [(g.end - g.start, g.length) for g in plan.decode_groups] == [(10, 16)] + long_tiles
        assert sorted(plan.decode_rows.tolist()) == list(range(20))
        assert plan.prefills == []
        check_cpu(batch, plan=plan)


def test_a_sequence_longer_than_a_tile_is_a_tile_alone():
    with attention_path("batched"):
        lens = [cpu_attention.tile_rows() + 5, 300, 310]
        batch = build_batch([1, 1, 1], [n - 1 for n in lens], num_kv_heads=1, group=1, head_dim=32,
                            block_size=16, dtype=torch.float32, seed=0)
        plan = cpu_attention.plan_attention(*batch[3:], 16)
        assert [(g.end - g.start, g.length) for g in plan.decode_groups] == [(2, 310), (1, lens[0])]
        assert plan.decode_rows.tolist() == [1, 2, 0]
        check_cpu(batch, plan=plan)


def test_plan_repr_is_plain():
    with attention_path("batched"):
        batch = build_batch([1, 5], [20, 0], num_kv_heads=1, group=2, head_dim=32, block_size=16,
                            dtype=torch.float32, seed=0)
        plan = cpu_attention.plan_attention(*batch[3:], 16)
        assert repr(plan) == "AttentionPlan(decode_groups(seqs, length)=[(1, 21)], prefills=[(5, 5)])"
    with attention_path("few-tokens"):
        assert repr(cpu_attention.plan_attention(*batch[3:], 16)) == "AttentionPlan(few tokens: one numba call)"


def _layout(q_lens, seq_lens):
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return cpu_few_tokens_attention.layout(torch.zeros(len(q_lens), 1, dtype=torch.int32), starts,
                                           torch.tensor(seq_lens, dtype=torch.int32))


@pytest.mark.parametrize("threads", [1, 2])
def test_the_few_tokens_kernel_takes_decodes_and_verify_chunks(threads):
    """Worked by hand from the two limits: at most MAX_QUERY_TOKENS (6) query tokens a
    sequence; at most MAX_POSITIONS (16,384) cached positions, unless torch has one thread."""
    if not cpu_few_tokens_attention.available():
        pytest.skip("numba does not import")
    takes = cpu_few_tokens_attention.takes_step
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert takes(_layout([1] * 8, [200] * 8))                   # decodes
        assert takes(_layout([5, 1, 6], [300, 40, 100]))            # verify chunks of k <= 5
        assert not takes(_layout([7], [300]))                       # a chunk of 7
        assert not takes(_layout([1, 64], [300, 64]))               # a prefill beside a decode
        assert not takes(_layout([0, 0], [3, 4]))                   # nothing to attend
        assert takes(_layout([1] * 64, [256] * 64))                 # 16,384 positions
        assert takes(_layout([1] * 65, [256] * 65)) == (threads == 1)
    finally:
        torch.set_num_threads(before)


def test_unknown_backend_is_named():
    batch = build_batch([1], [3], num_kv_heads=1, group=1, head_dim=32, block_size=16,
                        dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.paged_attention(*batch, 1.0, backend="fast")


@pytest.fixture(params=["numba", "torch"])
def rope_kv_path(request, monkeypatch):
    """Each test below runs on both paths of the fp32 RoPE and KV write: the numba kernels
    (kernels/cpu_rope_kv.py) and the torch operations a machine without numba takes."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_rope_kv, "_compiled", lambda: None)
    assert cpu_rope_kv.available() == (request.param == "numba")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("skip_one", [False, True])
def test_write_kv_cache_matches_reference(dtype, skip_one, rope_kv_path):
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(9, 2, 8, generator=gen)
    value = torch.randn(9, 2, 8, generator=gen)
    slots = torch.randperm(40, generator=gen)[:9]
    if skip_one:
        slots[4] = -1
    check_write_kv_cache(key, value, slots, 5, 8, backend="cpu", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_equals_reference_on_fused_qkv_views(dtype, rope_kv_path):
    """Bit for bit (fp32) on strided views of one fused QKV output, as the model calls it; on
    torch's path the plan's tables, built by the first call, serve a second layer's call
    unchanged (the numba kernel reads the cos/sin cache directly)."""
    from workbench.model.rotary import build_cos_sin_cache

    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, tokens = 6, 3, 32, 11
    cos_sin = build_cos_sin_cache(dim, 64, 10000.0)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    plan = cpu_attention.plan_attention(torch.zeros((1, 1), dtype=torch.int32),
                                        torch.tensor([0, tokens], dtype=torch.int32),
                                        torch.tensor([tokens], dtype=torch.int32), 16)
    for _layer in range(2):
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
        q_ref = qkv[:, :heads * dim].reshape(tokens, heads, dim).clone()
        k_ref = qkv[:, heads * dim:(heads + kv_heads) * dim].reshape(tokens, kv_heads, dim).clone()
        reference.rotary_embedding(positions, q_ref, k_ref, cos_sin)
        q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
        ops.rotary_embedding(positions, q, k, cos_sin, backend="cpu", plan=plan)
        torch.testing.assert_close(q, q_ref, atol=0, rtol=0)
        torch.testing.assert_close(k, k_ref, atol=0, rtol=0)
    assert len(plan.rotary) == (1 if dtype == torch.float32 and rope_kv_path == "torch" else 0)


def test_the_kv_write_of_a_prefill_and_an_empty_step(rope_kv_path):
    """Many tokens of fused-qkv views with int32 slots (as the runner builds them), and none."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(37, 4 * 16, generator=gen)
    _, key, value = qkv.split([32, 16, 16], dim=-1)
    key, value = key.view(37, 1, 16), value.view(37, 1, 16)
    slots = torch.randperm(48, generator=gen)[:37].int()
    check_write_kv_cache(key, value, slots, 3, 16, backend="cpu", dtype=torch.float32)
    check_write_kv_cache(key[:0], value[:0], slots[:0], 3, 16, backend="cpu", dtype=torch.float32)
