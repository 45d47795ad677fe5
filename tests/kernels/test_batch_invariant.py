"""Batch-invariant mode: a request's logprobs are bitwise equal alone, in any batch, under any
policy, with its prompt chunked and with its prefix from the cache (``EngineConfig(
batch_invariant=True)``); the invariant kernels agree with the references; the Triton variant
(interpreter, fp32, tiny shapes) is invariant too.
"""

from __future__ import annotations

import argparse
import random
import threading

import pytest
import torch
import torch.nn.functional as F

from workbench import EngineConfig, LLMEngine, SamplingParams
from workbench.benchmarks.checks import build_batch
from workbench.benchmarks.throughput import ThroughputResult, build_parser, format_table
from workbench.config import EngineArgs
from workbench.kernels import batch_invariant as bi
from workbench.kernels import reference, triton_attention

PREFIX = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
PROMPTS = [
    PREFIX + "It is the east",
    PREFIX + "JULIET:\nAy me!",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "KING HENRY:\nOnce more unto the breach, dear friends",
    "HAMLET:\nTo be, or not to be",
    "MENENIUS:\nWhat work's, my countrymen, in hand?",
]


# ----------------------------------------------------------------------------- kernels

def test_matmul_rows_do_not_depend_on_their_companions():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 96, generator=gen)
    x = torch.randn(40, 96, generator=gen)
    alone = [bi.matmul(x[i:i + 1], w.t()) for i in range(len(x))]
    for rows in (2, 3, 16, 17, 40):
        together = bi.matmul(x[:rows], w.t())
        for i in range(rows):
            assert torch.equal(together[i], alone[i][0])
    torch.testing.assert_close(bi.matmul(x, w.t()), x @ w.t(), atol=1e-5, rtol=1e-5)


def test_the_mode_routes_every_form_of_matmul_and_silu():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(64, 48, generator=gen)
    x = torch.randn(5, 48, generator=gen)
    want = bi.matmul(x, w.t())
    with torch.inference_mode(), bi.batch_invariant_mode():
        buf = torch.empty(5, 64)
        torch.mm(x, w.t(), out=buf)
        forms = [F.linear(x, w), torch.matmul(x[None], w.t())[0], x @ w.t(), buf,
                 torch.addmm(torch.zeros(64), x, w.t())]
        act = want.clone()
        F.silu(act, inplace=True)
    assert all(torch.equal(f, want) for f in forms)
    assert torch.equal(act, bi.silu(want))


def test_tree_sum_is_a_sum_and_ignores_trailing_zeros():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 37, generator=gen)
    torch.testing.assert_close(bi.tree_sum(x, -1), x.sum(-1), atol=1e-5, rtol=1e-5)
    padded = torch.cat([x, torch.zeros(5, 100)], dim=1)
    assert torch.equal(bi.tree_sum(padded, -1), bi.tree_sum(x, -1))
    assert torch.equal(bi.tree_sum(x.t(), 0, keepdim=True), bi.tree_sum(x, -1)[None])


def test_normalisations_match_torch():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 300, generator=gen) * 3
    x[3, :] = float("-inf")
    torch.testing.assert_close(bi.softmax(x[[0, 1, 2, 4]]), torch.softmax(x[[0, 1, 2, 4]], -1))
    assert torch.equal(bi.softmax(x)[3], torch.zeros(300))  # a fully masked row: zeros, not NaN
    torch.testing.assert_close(bi.log_softmax(x[:3]), torch.log_softmax(x[:3], -1))
    torch.testing.assert_close(bi.silu(x), F.silu(x).nan_to_num(0.0))
    w, r = torch.randn(300, generator=gen), torch.randn(7, 300, generator=gen)
    y = x[[0, 1, 2, 4, 5, 6]]
    for got, want in zip(bi.rms_norm(y, w, 1e-5, r[:6]), reference.rms_norm(y, w, 1e-5, r[:6])):
        torch.testing.assert_close(got, want)


def test_the_mode_is_thread_local_and_reentrant():
    seen = []
    with bi.batch_invariant_mode():
        with bi.batch_invariant_mode():
            assert bi.enabled()
        assert bi.enabled()
        thread = threading.Thread(target=lambda: seen.append(bi.enabled()))
        thread.start()
        thread.join()
    assert seen == [False] and not bi.enabled()


def _sub_batch(batch, seqs, split=None):
    """Sequences ``seqs`` of ``batch`` (same cache), in that order; ``split=(s, c)`` makes the
    first ``c`` new tokens of sequence ``s`` a separate, earlier chunk."""
    query, key_cache, value_cache, tables, qsl, seq_lens = batch
    rows, q_lens, lens, table_rows = [], [], [], []
    for s in seqs:
        a, b = int(qsl[s]), int(qsl[s + 1])
        pieces = [(a, b)]
        if split is not None and split[0] == s:
            pieces = [(a, a + split[1]), (a + split[1], b)]
        for lo, hi in pieces:
            rows.append(torch.arange(lo, hi))
            q_lens.append(hi - lo)
            lens.append(int(seq_lens[s]) - (b - hi))
            table_rows.append(s)
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(q_lens).cumsum(0)
    rows = torch.cat(rows)
    return (query[rows], key_cache, value_cache, tables[table_rows], starts,
            torch.tensor(lens, dtype=torch.int32)), rows


def _rows_of(out, rows, wanted):
    """The output rows of the original query rows ``wanted``, from a sub-batch's output."""
    where = {int(r): i for i, r in enumerate(rows)}
    return out[[where[int(r)] for r in wanted]]


ATTENTION_CASE = dict(q_lens=[9, 1, 20, 1, 3], ctx_lens=[70, 40, 5, 130, 0], num_kv_heads=2,
                      group=2, head_dim=32, block_size=16, dtype=torch.float32, seed=3)


@pytest.mark.parametrize("sliding_window", [None, 33])
@pytest.mark.parametrize("impl", ["cpu", "triton"])
def test_attention_rows_are_the_same_alone_batched_and_chunked(impl, sliding_window):
    batch = build_batch(**ATTENTION_CASE)
    scale = 32 ** -0.5

    def attend(b):
        if impl == "cpu":
            return bi.paged_attention(*b, scale, sliding_window=sliding_window)
        return triton_attention.paged_attention(*b, scale, sliding_window=sliding_window,
                                                batch_invariant=True)

    full = attend(batch[:6])
    expected = reference.paged_attention(*batch, scale, sliding_window=sliding_window)
    torch.testing.assert_close(full, expected, atol=2e-5, rtol=1e-4)
    qsl = batch[4]
    rng = random.Random(0)
    for s in range(5):
        mine = torch.arange(int(qsl[s]), int(qsl[s + 1]))
        others = [o for o in range(5) if o != s]
        variants = [[s], rng.sample(others, 2) + [s], rng.sample(range(5), 5)]
        splits = [None] * 3 + ([(s, len(mine) // 2)] if len(mine) > 1 else [])
        for seqs, split in zip(variants + [[s]], splits):
            sub, rows = _sub_batch(batch, seqs, split)
            got = _rows_of(attend(sub), rows, mine)
            assert torch.equal(got, full[mine]), (s, seqs, split)


# ----------------------------------------------------------------------------- the engine

def _run(backend, *, batch_invariant=True, order, policy="fcfs", budget=512, max_num_seqs=8,
         warm=(), prefix_caching=True, seed=0, prompt_logprobs=2):
    """Each prompt's (tokens, sampled-token logprobs, prompt logprobs), run together after
    the ``warm`` prompts; and the prefix-cache hits (tokens) of the prompts' run (a request
    that asks for prompt logprobs computes its whole prompt, as in vLLM)."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    engine = LLMEngine(EngineConfig(
        attention_backend=backend, device=device, batch_invariant=batch_invariant, block_size=4,
        num_kv_blocks=160, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
        policy=policy, enable_prefix_caching=prefix_caching, seed=seed))
    for i, prompt in enumerate(warm):
        engine.add_request(f"warm{i}", prompt, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    warm_steps = len(engine.history)
    rng = random.Random(seed)
    for i in order:
        params = SamplingParams(max_tokens=5, logprobs=2, prompt_logprobs=prompt_logprobs,
                                **({"temperature": 0.0} if i % 2 else {"temperature": 0.9, "seed": i}))
        engine.add_request(f"r{i}", PROMPTS[i], params,
                           priority=rng.randint(0, 3) if policy == "priority" else 0)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[int(out.request_id[1:])] = (c.token_ids, c.logprobs, out.prompt_logprobs)
    hits = sum(r.scheduler_output.num_prefix_cache_hit_tokens
               for r in list(engine.history)[warm_steps:])
    return done, hits


@pytest.fixture(scope="module", params=["cpu", "torch"])
def alone(request):
    """Each prompt run on its own (no companions, no cache hits), in batch-invariant mode."""
    backend = request.param
    return backend, {i: _run(backend, order=[i], prefix_caching=False)[0][i]
                     for i in range(len(PROMPTS))}


@pytest.mark.parametrize("policy, seed", [("fcfs", 1), ("spf", 2), ("priority", 3)])
def test_logprobs_are_bitwise_equal_in_random_batches(alone, policy, seed):
    backend, expected = alone
    rng = random.Random(seed)
    order = rng.sample(range(len(PROMPTS)), rng.randint(4, len(PROMPTS)))
    got, _ = _run(backend, order=order, policy=policy, max_num_seqs=rng.randint(2, 6), seed=seed)
    for i in order:
        assert got[i] == expected[i], (policy, seed, i)


def test_logprobs_are_bitwise_equal_with_chunked_prefill_and_prefix_hits(alone):
    backend, expected = alone
    order = list(range(len(PROMPTS)))
    chunked, _ = _run(backend, order=order, budget=7)
    cached, hits = _run(backend, order=[1, 0, 4], warm=[PREFIX + "It is", PROMPTS[4]],
                        prompt_logprobs=None)
    assert hits >= 3 * 8  # each of the three found at least its first two 4-token blocks
    for i in order:
        assert chunked[i] == expected[i], ("chunked", i)
    for i in (1, 0, 4):  # tokens and sampled-token logprobs (no prompt logprobs there)
        assert cached[i][:2] == expected[i][:2], ("prefix hit", i)


def test_without_the_mode_a_row_depends_on_its_batch(monkeypatch):
    """The dependence the mode removes, built deterministically (the engine-level view, a
    prompt's logprobs alone and in a batch, is notebooks/09's demonstration). A decode over
    201 keys has a block table 14 blocks wide alone: 224 positions, under ``SPLIT_MIN_CONTEXT``,
    one pass. Beside a decode over 2101 keys the batch's table is 133 blocks wide (2128
    positions): ``choose_num_splits`` cuts every row's keys into 4 chunks merged by their
    log-sum-exp, another order of the same sums, so the row's bits change while it stays
    within rounding of the reference; with ``batch_invariant=True`` they do not."""
    splits = []
    real = triton_attention.paged_attention_split_kv

    def spy(*args, num_splits, **kw):
        splits.append(num_splits)
        return real(*args, num_splits=num_splits, **kw)

    monkeypatch.setattr(triton_attention, "paged_attention_split_kv", spy)
    batch = build_batch([1, 1], [200, 2100], num_kv_heads=1, group=2, head_dim=32,
                        block_size=16, dtype=torch.float32, seed=7)
    query, key_cache, value_cache, tables, qsl, seq_lens = batch
    alone = (query[:1], key_cache, value_cache, tables[:1, :14],
             torch.tensor([0, 1], dtype=torch.int32), seq_lens[:1])
    scale = 32 ** -0.5
    expected = reference.paged_attention(*alone, scale)
    results = {}
    for invariant in (False, True):
        row_alone = triton_attention.paged_attention(*alone, scale, batch_invariant=invariant)
        together = triton_attention.paged_attention(*batch, scale, batch_invariant=invariant)
        torch.testing.assert_close(row_alone, expected, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(together[:1], expected, atol=2e-5, rtol=1e-4)
        results[invariant] = torch.equal(row_alone, together[:1])
    assert splits == [1, 4, 1, 1]  # (alone, together) without the mode, then with it
    assert results == {False: False, True: True}


def test_the_option_is_a_cli_flag_and_shows_in_the_repr():
    args = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--batch-invariant"])
    assert EngineArgs.from_cli_args(args).create_engine_config().batch_invariant is True
    engine = LLMEngine(EngineConfig(batch_invariant=True, num_kv_blocks=8))
    assert "batch_invariant=True" in repr(engine) and "batch-invariant" in engine._repr_html_()


def test_bench_throughput_flag_adds_a_row_for_the_mode():
    assert build_parser().parse_args(["--batch-invariant"]).batch_invariant
    assert not build_parser().parse_args([]).batch_invariant
    rows = [ThroughputResult("workbench", 300, 1.0, 3),
            ThroughputResult("workbench-batch-invariant", 300, 3.0, 3)]
    assert format_table(rows).splitlines()[2].split()[:5] == [
        "workbench-batch-invariant", "100.0", "1.00", "3.00", "3.00"]


@pytest.mark.slow
def test_triton_engine_logprobs_are_bitwise_equal_alone_and_batched():
    """The Triton path end to end: every kernel of the forward through the interpreter (fp32),
    or on the GPU when there is one."""
    alone, _ = _run("triton", order=[2], prefix_caching=False)
    together, _ = _run("triton", order=[4, 2, 5], budget=9)
    assert together[2] == alone[2]
