"""The few-rows kernel equals ``F.linear`` (up to fp32 rounding) for 1-8 rows of any shape, takes only what it can
(fp32 CPU rows, an output-major weight, no autograd), and a machine without numba keeps
torch's path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workbench.kernels import cpu_few_rows, cpu_linear


@pytest.mark.parametrize("rows", range(1, cpu_few_rows.MAX_ROWS + 1))
@pytest.mark.parametrize("out_features, in_features", [(1024, 192), (387, 61), (1, 5), (2, 7), (4096, 17)])
def test_equals_f_linear_with_and_without_bias(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    weight, bias = torch.randn(out_features, in_features, generator=gen), torch.randn(out_features, generator=gen)
    assert cpu_few_rows.available()
    for b in (None, bias):  # against fp64: fp32 sums of up to 192 products differ in the last bits
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double()).float()
        torch.testing.assert_close(cpu_few_rows.linear(x, weight, b), exact, rtol=1e-5, atol=1e-4)


def test_a_strided_view_of_the_rows_is_read_as_its_values():
    """A fused projection's slice or a gather of rows reaches it as a view."""
    weight, x = torch.randn(64, 32), torch.randn(6, 48)[:, 8:40]
    torch.testing.assert_close(cpu_few_rows.linear(x, weight), F.linear(x, weight))


def test_a_row_does_not_depend_on_the_rows_beside_it_within_a_group():
    """Rows 0-3 are one group of four: each is its own dot product, whatever the others hold."""
    weight, x = torch.randn(256, 96), torch.randn(4, 96)
    y = cpu_few_rows.linear(x, weight)
    x2 = x.clone()
    x2[1:] = torch.randn(3, 96)
    assert torch.equal(cpu_few_rows.linear(x2, weight)[0], y[0])


def test_it_takes_only_few_fp32_cpu_rows_of_an_output_major_weight_without_autograd():
    x, weight = torch.randn(5, 192), torch.randn(1024, 192)
    assert cpu_few_rows.eligible(x, weight)
    assert not cpu_few_rows.eligible(torch.randn(cpu_few_rows.MAX_ROWS + 1, 192), weight)
    assert not cpu_few_rows.eligible(torch.randn(0, 192), weight)
    assert not cpu_few_rows.eligible(x, weight.t().contiguous().t())  # input-major
    assert not cpu_few_rows.eligible(x.half(), weight.half())
    assert not cpu_few_rows.eligible(x, weight.double())
    assert not cpu_few_rows.eligible(x.requires_grad_(), weight)
    assert not cpu_few_rows.eligible(torch.randn(1, 5, 192), weight)


def test_without_numba_products_take_torchs_path(monkeypatch):
    monkeypatch.setattr(cpu_few_rows, "_compiled", lambda: None)
    monkeypatch.setenv("WORKBENCH_CPU_GEMM", "numba")
    cpu_linear._decide_few_rows.cache_clear()
    try:
        assert not cpu_few_rows.available() and not cpu_linear.few_rows_pays()
        x, weight = torch.randn(5, 192), torch.randn(1024, 192)
        torch.testing.assert_close(cpu_linear.linear(x, weight), F.linear(x, weight))
    finally:
        cpu_linear._decide_few_rows.cache_clear()


def test_without_a_writable_cache_directory_it_compiles_in_memory(monkeypatch):
    import numba

    compile_ = numba.njit

    def njit(*args, cache=False, **kwargs):
        if cache:  # what numba raises where no cache directory can be written
            raise RuntimeError("cannot cache function '_dot_rows': no locator available for file")
        return compile_(*args, **kwargs)

    monkeypatch.setattr(numba, "njit", njit)
    cpu_few_rows._compiled.cache_clear()
    try:
        x, weight = torch.randn(3, 40), torch.randn(24, 40)
        assert cpu_few_rows.available()
        torch.testing.assert_close(cpu_few_rows.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    finally:
        cpu_few_rows._compiled.cache_clear()
