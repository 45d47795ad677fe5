"""The kernels' entry points (``from workbench.kernels import ops``): each public function
dispatches to one backend (same signature, same result up to rounding):

* ``"torch"``: the plain-torch reference, :mod:`workbench.kernels.reference` (the oracle);
* ``"triton"``: the Triton kernels (CUDA; on CPU only under ``TRITON_INTERPRET=1``);
* ``"cpu"``: :mod:`workbench.kernels.cpu_attention` for attention, the KV write and RoPE,
  batched for CPU speed, and :mod:`workbench.kernels.cpu_norm` for RMSNorm (fp32 rows, where
  numba imports; the reference otherwise).

``backend=None`` picks Triton for CUDA tensors and the reference otherwise. Inside
:func:`~workbench.kernels.batch_invariant.batch_invariant_mode`, attention and RMSNorm take their
batch-invariant forms: :mod:`workbench.kernels.batch_invariant` off Triton, the fixed-configuration
Triton attention on it.

``kernels/`` has no ``__init__.py`` on purpose: installed as the subpackage ``workbench.kernels``
(setuptools ``package-dir``), it is a namespace package, and so is the folder seen from the
repository root, where ``python -m ...`` puts the checkout first on ``sys.path``. A namespace
portion loses to a regular package of the same name anywhere on the path (PEP 420), so there
``import kernels`` still finds the library that owns the name (transformers >= 5.25 imports it).
"""

from __future__ import annotations

import torch

from workbench.kernels import batch_invariant, reference

__all__ = ["paged_attention", "plan_attention", "write_kv_cache", "rms_norm", "rotary_embedding", "describe_cpu",
           "plan_lora", "add_lora", "reference", "batch_invariant", "BACKENDS"]

BACKENDS = ("torch", "triton", "cpu")


def _use_triton(backend: str | None, tensor: torch.Tensor) -> bool:
    if backend is None:
        return tensor.is_cuda
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}.")
    return backend == "triton"


def plan_attention(block_tables, query_start_loc, seq_lens, block_size, *, backend=None):
    """The layout work of :func:`paged_attention` that every layer of one forward shares: an
    opaque plan to pass as ``plan=`` (``None`` for backends that need none)."""
    if batch_invariant.enabled():
        return None if backend == "triton" else batch_invariant.AttentionPlan()
    if backend != "cpu":
        return None
    from workbench.kernels import cpu_attention

    return cpu_attention.plan_attention(block_tables, query_start_loc, seq_lens, block_size)


def paged_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                    scale, *, sliding_window=None, softcap=None, out=None, backend=None, plan=None):
    """See :func:`workbench.kernels.reference.paged_attention` for the contract; ``plan``
    comes from :func:`plan_attention` on the same inputs (optional)."""
    invariant = batch_invariant.enabled()
    if invariant and not _use_triton(backend, query):
        return batch_invariant.paged_attention(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
            sliding_window=sliding_window, softcap=softcap, out=out, plan=plan)
    if backend == "cpu":
        from workbench.kernels import cpu_attention

        return cpu_attention.paged_attention(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
            sliding_window=sliding_window, softcap=softcap, out=out, plan=plan)
    if _use_triton(backend, query):
        from workbench.kernels import triton_attention

        return triton_attention.paged_attention(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
            sliding_window=sliding_window, softcap=softcap, out=out, batch_invariant=invariant)
    return reference.paged_attention(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
        sliding_window=sliding_window, softcap=softcap, out=out)


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, backend=None):
    """See :func:`workbench.kernels.reference.write_kv_cache`."""
    if backend == "cpu":
        from workbench.kernels import cpu_attention

        return cpu_attention.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    if _use_triton(backend, key):
        from workbench.kernels import triton_cache

        return triton_cache.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    return reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def rms_norm(x, weight, eps, residual=None, *, backend=None):
    """See :func:`workbench.kernels.reference.rms_norm`."""
    if _use_triton(backend, x):  # one program per row: batch-invariant as it is
        from workbench.kernels import triton_norm

        return triton_norm.rms_norm(x, weight, eps, residual)
    if batch_invariant.enabled():
        return batch_invariant.rms_norm(x, weight, eps, residual)
    if backend == "cpu":
        from workbench.kernels import cpu_norm

        if cpu_norm.eligible(x, weight, residual):
            return cpu_norm.rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def rotary_embedding(positions, query, key, cos_sin_cache, *, backend=None, plan=None):
    """See :func:`workbench.kernels.reference.rotary_embedding`; ``plan`` as for
    :func:`paged_attention` (the cpu backend keeps the forward's cos/sin rows in it; in the
    batch-invariant mode the plan is that mode's, and the reference, which the cpu path equals
    bit for bit, runs)."""
    if backend == "cpu" and not batch_invariant.enabled():
        from workbench.kernels import cpu_attention

        return cpu_attention.rotary_embedding(positions, query, key, cos_sin_cache, plan=plan)
    if _use_triton(backend, query):
        from workbench.kernels import triton_rope

        return triton_rope.rotary_embedding(positions, query, key, cos_sin_cache)
    return reference.rotary_embedding(positions, query, key, cos_sin_cache)


def describe_cpu() -> str:
    """The ``"cpu"`` backend's kernels for fp32 tensors in a few words (benchmark headers)."""
    from workbench.kernels import cpu_few_tokens_attention, cpu_norm, cpu_rope_kv

    if not (cpu_norm.available() and cpu_rope_kv.available() and cpu_few_tokens_attention.available()):
        return "torch (numba does not import)"
    return ("numba RMSNorm, RoPE, KV write, and attention of steps of <= "
            f"{cpu_few_tokens_attention.MAX_QUERY_TOKENS} query tokens a sequence")


def plan_lora(token_lora_indices, *, backend=None):
    """The grouping of a forward's tokens by adapter slot that every LoRA projection of it
    shares: an opaque plan for :func:`add_lora` (``None`` for backends that need none)."""
    if backend != "cpu":
        return None
    from workbench.kernels import cpu_lora

    return cpu_lora.plan_lora(token_lora_indices)


def add_lora(y, x, lora_a, lora_b, token_lora_indices, *, backend=None, plan=None):
    """See :func:`workbench.kernels.reference.add_lora`; ``plan`` from :func:`plan_lora`."""
    if backend == "cpu":
        from workbench.kernels import cpu_lora

        return cpu_lora.add_lora(y, x, lora_a, lora_b, token_lora_indices, plan=plan)
    if _use_triton(backend, x):
        from workbench.kernels import triton_lora

        return triton_lora.add_lora(y, x, lora_a, lora_b, token_lora_indices)
    return reference.add_lora(y, x, lora_a, lora_b, token_lora_indices)
