"""RoPE in place and the paged KV write for fp32 CPU tensors, one numba call each.

Contracts: :func:`workbench.kernels.reference.rotary_embedding` bit for bit (the same fp32
products and differences, rounded one at a time: compiled without fastmath, so no fused
multiply-adds), and :func:`workbench.kernels.reference.write_kv_cache` (a copy: bit for bit,
slots of -1 skipped). Both read ``query``, ``key`` and ``value`` as the strided views of the
fused qkv projection they are, and write where they point.

Why: torch spends 4-5 us dispatching each of the ~8 operations these take on a decode's few
rows (30-35 us a call for RoPE and 25-30 for the write on the embedded model, once per layer)
where one numba call takes a few. Where numba cannot be imported, :func:`available` is False
and :mod:`workbench.kernels.cpu_attention` keeps its torch operations.
"""

from __future__ import annotations

import functools

import torch

from workbench.kernels import cpu_numba


def _rotate(positions, cos_sin, query, key):
    """Per token i, for every head of ``query`` and ``key``: (x1, x2) -> (x1 cos - x2 sin,
    x2 cos + x1 sin), the halves of the head, cos and sin the halves of cos_sin[positions[i]]."""
    half = query.shape[2] // 2
    for i in range(positions.shape[0]):
        table = cos_sin[positions[i]]
        for t in (query, key):
            for h in range(t.shape[1]):
                head = t[i, h]
                for j in range(half):
                    cos, sin = table[j], table[half + j]
                    x1, x2 = head[j], head[half + j]
                    head[j] = x1 * cos - x2 * sin
                    head[half + j] = x2 * cos + x1 * sin


def _write(key, value, key_rows, value_rows, slots):
    """key_rows[slots[i]] = key[i] and value_rows[slots[i]] = value[i], skipping slots < 0."""
    for i in range(slots.shape[0]):
        slot = slots[i]
        if slot >= 0:
            key_rows[slot] = key[i]
            value_rows[slot] = value[i]


@functools.cache
def _compiled():
    """(rotate, write) compiled by numba, or None where numba cannot be imported."""
    rotate = cpu_numba.njit(_rotate, "void(int64[::1], float32[:, ::1], float32[:, :, :], float32[:, :, :])",
                            fastmath=False)
    write = cpu_numba.njit(_write, "void(float32[:, :, :], float32[:, :, :], float32[:, :, ::1], "
                                   "float32[:, :, ::1], int64[::1])", fastmath=False)
    return None if rotate is None else (rotate, write)


def available() -> bool:
    """Whether the kernels can run here (numba imports); compiles them on the first call."""
    return _compiled() is not None


def _numpy(t: torch.Tensor):
    """A CPU tensor's numpy view (no copy), for tensors that take no autograd."""
    return t.detach().numpy()


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """RoPE in place on fp32 ``query`` [tokens, q_heads, head_dim] and ``key`` [tokens,
    kv_heads, head_dim] with an fp32 ``cos_sin_cache``; the caller checked the dtypes."""
    _compiled()[0](_numpy(positions.long().contiguous()), _numpy(cos_sin_cache.contiguous()),
                   _numpy(query), _numpy(key))


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The paged KV write for fp32 ``key``/``value`` and fp32 contiguous caches; the caller
    checked the dtypes."""
    num_blocks, block_size, kv_heads, head_dim = key_cache.shape
    rows = (num_blocks * block_size, kv_heads, head_dim)
    _compiled()[1](_numpy(key), _numpy(value), _numpy(key_cache.view(rows)),
                   _numpy(value_cache.view(rows)), _numpy(slot_mapping.long().contiguous()))
