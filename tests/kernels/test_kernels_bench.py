"""The kernel benchmark's CPU-checkable parts: the no-GPU exit, the work formulas, and one
tiny case run end to end (Triton interpreter, wall-clock timer) with its SDPA twin checked
against the reference so the comparison times the same attention."""

from __future__ import annotations

import time

import pytest
import torch

from workbench.kernels import bench, reference


def test_main_without_cuda_says_why_and_exits_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "RESULTS.md"
    assert bench.main(["--out", str(out)]) == 2
    assert "no CUDA device: the kernel benchmark needs a GPU" in capsys.readouterr().out
    assert not out.exists()


def test_work_formulas_hand_worked():
    shape = bench.Shape(num_q_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    case = bench.Case("c", "prefill", q_lens=(2, 1), ctx_lens=(3, 0))
    # queries see 4 and 5 keys (seq 0) and 1 key (seq 1): 10 (query, key) pairs per head
    assert bench.attention_flops(case, shape) == 4 * 8 * 4 * 10
    # K and V of 5 + 1 cached tokens, Q and O of 3 tokens, 2 bytes each
    assert bench.attention_bytes(case, shape) == (2 * 6 * 2 * 8 + 2 * 3 * 4 * 8) * 2
    assert bench.decode(4, 512).seq_lens == (512,) * 4
    assert bench.mixed(1, 8, 2, 16).q_lens == (8, 1, 1)


def test_format_table_plain_and_markdown():
    rows = [{"case": "a", "ms": 1.23456, "flex": None}, {"case": "bb", "ms": 20000.0, "flex": 2}]
    assert bench.format_table(rows, markdown=True).splitlines() == [
        "| case | ms | flex |", "|---|---|---|", "| a | 1.23 | - |", "| bb | 20000 | 2 |"]
    assert bench.format_table(rows, markdown=False).splitlines()[0] == "case  ms     flex"


SMALL = bench.Shape(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                    dtype=torch.float32)


@pytest.mark.parametrize("case", [bench.decode(2, 40), bench.prefill(1, 20),
                                  bench.prefill(2, 5, cached=18)], ids=lambda c: c.name)
def test_sdpa_twin_computes_the_same_attention(case):
    inputs = bench.build_inputs(case, SMALL, "cpu")
    expected = reference.paged_attention(*inputs.values(), SMALL.head_dim ** -0.5)
    got = bench.sdpa_fn(case, SMALL, inputs)()  # [batch, heads, q_len, head_dim]
    torch.testing.assert_close(got.transpose(1, 2).reshape(expected.shape), expected,
                               atol=1e-5, rtol=1e-5)


def test_run_case_on_cpu_with_a_wall_clock_timer():
    def time_ms(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    row = bench.run_case(bench.mixed(1, 6, 2, 20), SMALL, "cpu", time_ms, use_flex=False,
                         peak_gbs=None)
    assert row["max abs err"] < 1e-5
    assert row["splits"] == 1 and row["SDPA ms"] is None  # mixed batch: no dense twin
    assert row["triton ms"] > 0 and row["GB/s"] > 0
