"""Triton kernels against their torch references, run by the Triton interpreter on the CPU.

``tests/conftest.py`` sets ``TRITON_INTERPRET=1``. Shapes are small (the interpreter is slow) and
dtypes are fp32/fp16 only: the interpreter computes ``tl.dot`` on bfloat16 wrongly.
Every output is poisoned with NaN before the kernel runs, and every cache slot a kernel must not
read (past a sequence's length, unused blocks, block-table padding) holds NaN too, so an element
left unwritten or a read out of range fails the comparison.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.benchmarks.checks import (attention_batches, build_batch, check_paged_attention,
                                         check_rms_norm, check_rotary_embedding,
                                         check_write_kv_cache)
from workbench.kernels import triton_attention, triton_norm, triton_rope

DTYPES = [torch.float32, torch.float16]
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


# ----------------------------------------------------------------------------- paged attention
# (build_batch and the checks are workbench.benchmarks.checks: selftest runs them on a GPU)

def check_attention(batch, **kw):
    check_paged_attention(batch, backend="triton", **kw)


@pytest.mark.parametrize("sliding_window", [None, 48])
@pytest.mark.parametrize("kind", sorted(attention_batches(40, 70)))
def test_selftest_batches(kind, sliding_window):
    """The batches ``workbench selftest`` checks on a GPU, at its ``--small`` sizes."""
    q_lens, ctx_lens = attention_batches(40, 70)[kind]
    check_attention(build_batch(q_lens, ctx_lens, num_kv_heads=2, group=2, head_dim=64,
                                block_size=16, dtype=torch.float32, seed=len(kind)),
                    sliding_window=sliding_window)


@st.composite
def attention_cases(draw, max_seqs=4, max_q=40, max_ctx=80):
    block_size = draw(st.sampled_from([16, 32, 64]))
    # cache-block edges, and the kernel's 64-key tile edges (where its causal mask starts)
    boundary = st.sampled_from([0, 1, block_size - 1, block_size, block_size + 1, 62, 63, 64])
    num_seqs = draw(st.integers(1, max_seqs))
    q_lens, ctx_lens = [], []
    for _ in range(num_seqs):
        q_lens.append(draw(st.one_of(st.integers(0, max_q), st.sampled_from([0, 1, 1, 2]), boundary)))
        ctx_lens.append(draw(st.one_of(st.integers(0, max_ctx), boundary)))
    if sum(q_lens) == 0:
        q_lens[0] = 1
    return dict(
        q_lens=q_lens, ctx_lens=ctx_lens, block_size=block_size,
        num_kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 2, 4, 8])),
        head_dim=draw(st.sampled_from([32, 64, 80, 96, 128])),
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=40, **SETTINGS)
@given(case=attention_cases(),
       sliding_window=st.one_of(st.none(), st.integers(1, 70)),
       softcap=st.one_of(st.none(), st.floats(2.0, 30.0)))
def test_paged_attention_matches_reference(case, sliding_window, softcap):
    check_attention(build_batch(**case), sliding_window=sliding_window, softcap=softcap)


@settings(max_examples=16, **SETTINGS)
@given(case=attention_cases(max_seqs=3, max_q=20, max_ctx=200),
       num_splits=st.integers(2, 7),
       sliding_window=st.one_of(st.none(), st.integers(1, 120)),
       softcap=st.one_of(st.none(), st.floats(2.0, 30.0)))
def test_split_kv_matches_reference(case, num_splits, sliding_window, softcap):
    """The flash-decoding variant with its reduction kernel, forced, on mixed batches too."""
    check_attention(build_batch(**case), num_splits=num_splits, sliding_window=sliding_window,
                    softcap=softcap)


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128])
@pytest.mark.parametrize("block_size", [16, 64])
def test_every_head_and_block_size_on_a_mixed_batch(head_dim, block_size):
    """Decode, prefill, chunked prefill / prefix hit and an idle (q_len 0) sequence at once."""
    batch = build_batch([1, 9, 0, 5], [block_size + 3, 0, 4, block_size - 1], num_kv_heads=2,
                        group=4, head_dim=head_dim, block_size=block_size,
                        dtype=torch.float16, seed=head_dim + block_size)
    check_attention(batch)


@pytest.mark.parametrize("num_splits", [None, 3])
def test_sliding_window_deep_in_a_long_context(num_splits):
    """The window starts hundreds of positions in: only its tiles are walked, none skipped."""
    batch = build_batch([1, 7, 1], [300, 260, 17], num_kv_heads=1, group=2, head_dim=32,
                        block_size=16, dtype=torch.float32, seed=11)
    check_attention(batch, num_splits=num_splits, sliding_window=21)


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("num_splits", [None, 2])
def test_queries_next_to_a_key_tile_edge(group, num_splits):
    """Queries at positions 61..65 and a prefill crossing 64: the first query of a tile must
    not see the key after it even when that key starts a new 64-key tile."""
    batch = build_batch([1, 1, 1, 1, 3, 70], [61, 62, 63, 64, 61, 0], num_kv_heads=1,
                        group=group, head_dim=32, block_size=16, dtype=torch.float32, seed=5)
    check_attention(batch, num_splits=num_splits)


def test_hand_worked_two_keys():
    """One query, two cached keys: weights softmax([s0, s1]) computed by hand."""
    q = torch.tensor([[[1.0, 0.0] + [0.0] * 30]])                       # [1 token, 1 head, 32]
    k = torch.zeros(1, 16, 1, 32)
    v = torch.zeros(1, 16, 1, 32)
    k[0, 0, 0, 0], k[0, 1, 0, 0] = 2.0, 0.0                              # scores 2 and 0 (scale 1)
    v[0, 0, 0, 1], v[0, 1, 0, 1] = 1.0, 3.0
    out = triton_attention.paged_attention(
        q, k, v, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32), 1.0)
    w0 = math.exp(2) / (math.exp(2) + 1)
    assert out[0, 0, 1].item() == pytest.approx(w0 * 1.0 + (1 - w0) * 3.0, rel=1e-5)
    assert out[0, 0, 0].item() == 0.0


def test_choose_num_splits_heuristic():
    # decode, 2 sequences x 4 kv heads = 8 programs on 132 SMs, 32k context: 32 splits (cap).
    assert triton_attention.choose_num_splits(2, 2, 4, 32768, 132) == 32
    # 16 x 4 = 64 programs: cdiv(264, 64) = 5 splits.
    assert triton_attention.choose_num_splits(16, 16, 4, 32768, 132) == 5
    # context 2048: at most 2048 // 512 = 4 splits.
    assert triton_attention.choose_num_splits(1, 1, 8, 2048, 132) == 4
    assert triton_attention.choose_num_splits(1, 1, 8, 1024, 132) == 1      # short context
    assert triton_attention.choose_num_splits(64, 64, 4, 32768, 132) == 1   # grid already full
    assert triton_attention.choose_num_splits(9, 2, 4, 32768, 132) == 1     # has prefill tokens
    assert triton_attention.choose_num_splits(0, 0, 4, 32768, 132) == 1


def test_auto_path_picks_split_kv_for_long_decode(monkeypatch):
    """Lowered thresholds make a small decode batch take the split path, still correct."""
    monkeypatch.setattr(triton_attention, "SPLIT_MIN_CONTEXT", 64)
    monkeypatch.setattr(triton_attention, "SPLIT_MIN_TOKENS", 16)
    chosen = []
    real = triton_attention.paged_attention_split_kv

    def spy(*args, num_splits, **kw):
        chosen.append(num_splits)
        return real(*args, num_splits=num_splits, **kw)

    monkeypatch.setattr(triton_attention, "paged_attention_split_kv", spy)
    batch = build_batch([1, 1], [70, 20], num_kv_heads=2, group=2, head_dim=64, block_size=16,
                        dtype=torch.float32, seed=3)
    check_attention(batch)
    # block tables are 6 wide (5 blocks + padding) -> capacity 96 tokens -> 96 // 16 = 6 splits
    assert chosen == [6]


def test_attention_rejects_bad_inputs():
    q, kc, vc, bt, qsl, sl = build_batch([2], [3], num_kv_heads=2, group=2, head_dim=32,
                                         block_size=16, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        triton_attention.paged_attention(q[:, :3], kc, vc, bt, qsl, sl, 1.0)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        triton_attention.paged_attention(q, kc, vc, bt, qsl, sl.long(), 1.0)
    with pytest.raises(ValueError, match="share one dtype"):
        triton_attention.paged_attention(q.half(), kc, vc, bt, qsl, sl, 1.0)
    with pytest.raises(ValueError, match=r"num_splits must be in \[1, 32\]"):
        triton_attention.paged_attention_split_kv(q, kc, vc, bt, qsl, sl, 1.0, num_splits=0)


# ----------------------------------------------------------------------------- KV cache write

@settings(max_examples=12, **SETTINGS)
@given(num_tokens=st.integers(1, 12), num_kv_heads=st.sampled_from([1, 2, 3]),
       head_dim=st.sampled_from([32, 80, 128]), block_size=st.sampled_from([16, 32]),
       dtype=st.sampled_from(DTYPES), slot_dtype=st.sampled_from([torch.int32, torch.int64]),
       data=st.data())
def test_write_kv_cache_matches_reference(num_tokens, num_kv_heads, head_dim, block_size, dtype,
                                          slot_dtype, data):
    num_blocks = 3
    slots = data.draw(st.lists(st.integers(0, num_blocks * block_size - 1), min_size=num_tokens,
                               max_size=num_tokens, unique=True))
    skip = data.draw(st.lists(st.booleans(), min_size=num_tokens, max_size=num_tokens))
    slot_mapping = torch.tensor([-1 if s else x for s, x in zip(skip, slots)], dtype=slot_dtype)
    # key/value as strided views of one fused buffer, as a QKV projection produces them
    fused = torch.randn(num_tokens, 2, num_kv_heads, head_dim).to(dtype)
    key, value = fused[:, 0], fused[:, 1]
    check_write_kv_cache(key, value, slot_mapping, num_blocks, block_size, backend="triton")


# ----------------------------------------------------------------------------- RMSNorm

@settings(max_examples=12, **SETTINGS)
@given(rows=st.integers(1, 6), hidden=st.sampled_from([8, 64, 96, 200, 256]),
       dtype=st.sampled_from(DTYPES), with_residual=st.booleans(), seed=st.integers(0, 999))
def test_rms_norm_matches_reference(rows, hidden, dtype, with_residual, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen)
    residual = torch.randn(rows, 2, hidden, generator=gen).to(dtype) if with_residual else None
    check_rms_norm(x, weight, 1e-5, residual, backend="triton")


def test_rms_norm_hand_worked():
    x = torch.tensor([[3.0, 4.0]])  # mean square 12.5
    out = triton_norm.rms_norm(x, torch.tensor([1.0, 2.0]), 0.0)
    r = math.sqrt(12.5)
    torch.testing.assert_close(out, torch.tensor([[3.0 / r, 8.0 / r]]))


# ----------------------------------------------------------------------------- rotary embedding

@settings(max_examples=12, **SETTINGS)
@given(num_tokens=st.integers(1, 8), num_q_heads=st.sampled_from([1, 4, 6]),
       num_kv_heads=st.sampled_from([1, 2]), head_dim=st.sampled_from([32, 64, 80, 128]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 999))
def test_rotary_embedding_matches_reference(num_tokens, num_q_heads, num_kv_heads, head_dim,
                                            dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    max_pos = 64
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen)
    # q and k as strided views of one fused QKV buffer
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim:(num_q_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim)
    v_before = qkv[:, (num_q_heads + num_kv_heads) * head_dim:].clone()
    check_rotary_embedding(positions, q, k, cos_sin, backend="triton")
    assert torch.equal(qkv[:, (num_q_heads + num_kv_heads) * head_dim:], v_before)


def test_rotary_position_zero_is_identity_and_quarter_turn():
    """cos/sin of 0 leave x unchanged; cos 0, sin 1 maps (x1, x2) to (-x2, x1)."""
    cos_sin = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # head_dim 2: [cos, sin] per position
    q = torch.tensor([[[2.0, 5.0]], [[2.0, 5.0]]])
    k = q.clone()
    triton_rope.rotary_embedding(torch.tensor([0, 1]), q, k, cos_sin)
    torch.testing.assert_close(q, torch.tensor([[[2.0, 5.0]], [[-5.0, 2.0]]]))
    torch.testing.assert_close(k, q)
