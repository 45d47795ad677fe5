"""Plain-torch reference implementations of every kernel, same signatures as the Triton ones.

They are the correctness oracle for the Triton kernels and the default attention path on CPU.
Readable first: fp32 math, no fusion; attention loops over sequences, except that the
decode-only sequences of a step are done in one masked batch.
"""

from __future__ import annotations

import torch


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` [num_tokens, num_kv_heads, head_dim] into the paged caches
    [num_blocks, block_size, num_kv_heads, head_dim]; slot = block_id * block_size + offset,
    and a slot of -1 is skipped."""
    num_blocks, block_size = key_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache.view(num_blocks * block_size, *key_cache.shape[2:])[slots] = key[keep].to(key_cache.dtype)
    value_cache.view(num_blocks * block_size, *value_cache.shape[2:])[slots] = value[keep].to(
        value_cache.dtype
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over a paged KV cache.

    query [num_tokens, num_q_heads, head_dim]; key_cache/value_cache [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables int32 [num_seqs, max_blocks]; query_start_loc int32
    [num_seqs + 1]; seq_lens int32 [num_seqs] (cached tokens, new ones included).
    Query j of sequence s sits at position seq_lens[s] - q_len[s] + j and sees cached
    positions 0..that position (and, with ``sliding_window`` w, only the last w of them).
    """
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
    if len(decodes) > 1:
        _decode_attention(query, key_cache, value_cache, block_tables, starts, lens, decodes,
                          scale, sliding_window, softcap, out)
    done = set(decodes) if len(decodes) > 1 else set()
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0 or s in done:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[s, :num_blocks].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_q_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def _decode_attention(query, key_cache, value_cache, block_tables, starts, lens, seqs, scale,
                      sliding_window, softcap, out) -> None:
    """The sequences ``seqs`` (one query token each) in one batched computation: their
    caches are gathered into [len(seqs), max_len] with the tail masked. Same maths as the
    per-sequence loop, for the common all-decode step."""
    _, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    seq_lens = torch.tensor([lens[s] for s in seqs], device=query.device)
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // block_size)
    index = torch.tensor(seqs, device=query.device)
    tables = block_tables[index, :num_blocks].long().clamp_min(0)  # padding reads block 0, masked
    k = key_cache[tables].flatten(1, 2)[:, :max_len].float()  # [S, L, kv_heads, D]
    v = value_cache[tables].flatten(1, 2)[:, :max_len].float()
    rows = torch.tensor([starts[s] for s in seqs], device=query.device)
    q = query[rows].float().view(len(seqs), num_kv_heads, group, head_dim)
    scores = torch.einsum("skgd,slkd->skgl", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    k_pos = torch.arange(max_len, device=query.device)[None, :]
    q_pos = (seq_lens - 1)[:, None]
    visible = k_pos <= q_pos
    v = v.masked_fill(~visible[:, :, None, None], 0.0)  # padding may hold garbage (even NaN)
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    result = torch.einsum("skgl,slkd->skgd", probs, v).reshape(len(seqs), num_q_heads, head_dim)
    out[rows] = result.to(out.dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension, computed in fp32.

    With ``residual``: ``h = x + residual`` is normalised and ``(norm(h), h)`` is returned,
    the second being the residual stream for the next layer (vLLM's fused_add_rms_norm).
    """
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (h * weight.float()).to(x.dtype)
    return out if residual is None else (out, residual)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Neox-style rotary embedding, in place on ``query`` [num_tokens, num_q_heads, head_dim]
    and ``key`` [num_tokens, num_kv_heads, head_dim].

    ``cos_sin_cache`` is [max_position, head_dim]: cos in the first half, sin in the second.
    The first and second halves of each head are rotated as pairs (x1, x2) ->
    (x1 cos - x2 sin, x2 cos + x1 sin).
    """
    half = query.shape[-1] // 2
    cos_sin = cos_sin_cache[positions.long()].float()
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    for t in (query, key):
        x1, x2 = t[..., :half].float(), t[..., half:].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        t.copy_(rotated.to(t.dtype))


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_lora_indices: torch.Tensor,
) -> None:
    """The batched LoRA update, in place: for every token ``t`` with slot ``i =
    token_lora_indices[t] > 0``, ``y[t] += (x[t] @ lora_a[i].T) @ lora_b[i].T``; slot 0 ("no
    adapter") adds nothing. Gather-based: each token takes its own adapter's matrices.

    ``y`` [num_tokens, out] (any strides: a column slice of a fused projection's output),
    ``x`` [num_tokens, in], ``lora_a`` [num_slots, rank, in], ``lora_b`` [num_slots, out, rank]
    (the adapter's scaling already folded into ``lora_b``), ``token_lora_indices`` int
    [num_tokens]. fp32 math, cast to ``y``'s dtype.
    """
    idx = token_lora_indices.long()
    rows = (idx > 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    slots = idx[rows]
    h = torch.einsum("ti,tri->tr", x[rows].float(), lora_a[slots].float())
    delta = torch.einsum("tr,tor->to", h, lora_b[slots].float())
    y[rows] = (y[rows].float() + delta).to(y.dtype)
