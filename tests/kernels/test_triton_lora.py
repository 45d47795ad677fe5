"""The batched LoRA update: Triton (interpreter) and the CPU grouped path against the torch
reference, and the reference against a per-token loop written out here.

Shapes are small; fp32 and fp16. Slot 0 is "no adapter": its tokens' rows must come back
unchanged (bitwise), even where slot 0 is (wrongly) non-zero, since the kernels skip it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.kernels import ops
from workbench.kernels import reference

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True,
                max_examples=25)


def make_case(num_tokens, n_in, n_out, rank, num_slots, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, n_in, generator=gen).to(dtype)
    a = torch.randn(num_slots, rank, n_in, generator=gen).to(dtype)
    b = torch.randn(num_slots, n_out, rank, generator=gen).to(dtype)
    a[0] = float("nan")  # slot 0 must never be read
    idx = torch.randint(0, num_slots, (num_tokens,), generator=gen)
    # y as a column slice of a wider fused output (the projections' strided views)
    fused = torch.randn(num_tokens, n_out + 5, generator=gen).to(dtype)
    return fused, x, a, b, idx


def per_token_loop(y, x, a, b, idx):
    out = y.clone().float()
    for t, s in enumerate(idx.tolist()):
        if s > 0:
            out[t] += (x[t].float() @ a[s].float().T) @ b[s].float().T
    return out.to(y.dtype)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_each_backend_matches_a_per_token_loop(backend, dtype):
    fused, x, a, b, idx = make_case(13, 24, 20, 8, 4, seed=1, dtype=dtype)
    y = fused[:, 2:22]
    expected = per_token_loop(y, x, a, b, idx)
    before = fused.clone()
    ops.add_lora(y, x, a, b, idx, backend=backend,
                 plan=ops.plan_lora(idx, backend=backend))
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(y, expected, **tol)
    untouched = idx == 0
    assert torch.equal(fused[untouched], before[untouched]), "a slot-0 row changed"
    assert torch.equal(fused[:, :2], before[:, :2]) and torch.equal(fused[:, 22:], before[:, 22:])


@settings(**SETTINGS)
@given(num_tokens=st.integers(1, 20), n_in=st.integers(1, 40), n_out=st.integers(1, 40),
       rank=st.sampled_from([1, 2, 4, 8, 16]), num_slots=st.integers(1, 4), seed=st.integers(0, 99),
       contiguous=st.booleans())
def test_triton_and_cpu_equal_the_reference(num_tokens, n_in, n_out, rank, num_slots, seed, contiguous):
    fused, x, a, b, idx = make_case(num_tokens, n_in, n_out, rank, num_slots, seed)
    if contiguous:  # the usual runner layout: each request's tokens together
        idx = idx.sort().values
    expected = fused[:, :n_out].clone()
    reference.add_lora(expected, x, a, b, idx)
    for backend in ("triton", "cpu"):
        y = fused.clone()[:, :n_out]
        ops.add_lora(y, x, a, b, idx, backend=backend,
                     plan=ops.plan_lora(idx, backend=backend))
        torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)


def test_cpu_plan_groups_tokens_by_slot():
    plan = ops.plan_lora(torch.tensor([0, 2, 2, 1, 0, 1]), backend="cpu")
    assert [(s, r if isinstance(r, slice) else r.tolist()) for s, r in plan] == [
        (1, [3, 5]), (2, slice(1, 3))]
    assert ops.plan_lora(torch.tensor([0, 0]), backend="cpu") == []
    assert ops.plan_lora(torch.tensor([1]), backend="torch") is None
