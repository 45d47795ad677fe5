"""The numba RMSNorm equals the reference up to fp32 rounding for any number of rows, returns
the residual stream ``x + residual`` bit for bit, leaves its inputs alone, takes only fp32 CPU
rows, and a machine without numba keeps the reference."""

from __future__ import annotations

import pytest
import torch

from workbench.kernels import cpu_norm, ops, reference


def _exact(x, weight, eps, residual=None):
    """The reference in fp64: the oracle both fp32 paths are compared with."""
    h = x.double() if residual is None else x.double() + residual.double()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).float()


@pytest.mark.parametrize("rows", [1, 5, 96, 2048])
@pytest.mark.parametrize("size", [192, 7, 4096])
def test_equals_the_reference_with_and_without_a_residual(rows, size):
    gen = torch.Generator().manual_seed(rows * size)
    x, residual = torch.randn(rows, size, generator=gen), torch.randn(rows, size, generator=gen)
    weight = torch.randn(size, generator=gen)
    before = x.clone(), residual.clone()
    assert cpu_norm.eligible(x, weight, residual)
    normed, summed = cpu_norm.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(summed, x + residual)  # one IEEE add per element, as the reference's
    torch.testing.assert_close(normed, _exact(x, weight, 1e-6, residual), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_norm.rms_norm(x, weight, 1e-6), _exact(x, weight, 1e-6),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


def test_eps_keeps_a_zero_row_finite():
    x, weight = torch.zeros(2, 16), torch.ones(16)
    assert torch.equal(cpu_norm.rms_norm(x, weight, 1e-5), torch.zeros(2, 16))


def test_strided_rows_are_read_as_their_values():
    """A head's slice (Qwen3's q/k norm reshapes strided views) reaches it as a view."""
    x, weight = torch.randn(6, 48)[:, 8:40], torch.randn(32)
    torch.testing.assert_close(cpu_norm.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))


def test_ops_takes_it_on_the_cpu_backend_only_for_what_it_takes():
    x, weight = torch.randn(3, 64), torch.randn(64)
    assert cpu_norm.eligible(x, weight, None)
    assert not cpu_norm.eligible(x.half(), weight.half(), None)
    assert not cpu_norm.eligible(x, weight.double(), None)
    assert not cpu_norm.eligible(x[None], weight, None)
    assert not cpu_norm.eligible(x, torch.randn(63), None)
    assert not cpu_norm.eligible(x, weight, torch.randn(3, 64).double())
    assert not cpu_norm.eligible(x.requires_grad_(), weight, None)
    assert not cpu_norm.eligible(torch.randn(0, 64), weight, None)
    bf16 = torch.randn(3, 64, dtype=torch.bfloat16)  # falls back to the reference
    assert torch.equal(ops.rms_norm(bf16, weight.bfloat16(), 1e-6, backend="cpu"),
                       reference.rms_norm(bf16, weight.bfloat16(), 1e-6))


def test_without_numba_the_reference_runs(monkeypatch):
    monkeypatch.setattr(cpu_norm, "_compiled", lambda: None)
    x, weight = torch.randn(3, 64), torch.randn(64)
    assert not cpu_norm.eligible(x, weight, None)
    assert torch.equal(ops.rms_norm(x, weight, 1e-6, backend="cpu"), reference.rms_norm(x, weight, 1e-6))
