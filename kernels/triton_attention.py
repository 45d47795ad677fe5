"""Triton paged attention for a packed batch (decode, prefill, chunked prefill, prefix hits).

Contract: :func:`workbench.kernels.reference.paged_attention` (same signature, same result up to
floating-point rounding).

How the work is laid out
------------------------
* **Query tiles.** A program owns ``BLOCK_Q`` consecutive query tokens of one sequence and all
  ``group = num_q_heads // num_kv_heads`` query heads that share one KV head, packed as the
  ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows of one tile (row ``r`` is token ``r // GROUP_PAD`` and
  head ``r % GROUP_PAD`` of the group). Each K/V tile is then loaded once for the whole group
  (GQA packing). ``BLOCK_M >= 16`` so ``tl.dot`` compiles on real GPUs.
* **Grid without a host sync.** Sequence ``s`` owns the tile indices starting at
  ``T[s] = query_start_loc[s] // BLOCK_Q + s``. ``T`` is strictly increasing and
  ``T[s+1] - T[s] >= cdiv(q_len[s], BLOCK_Q)``, so a grid of
  ``num_tokens // BLOCK_Q + num_seqs`` programs covers every tile; a program finds its
  sequence by binary search over ``T`` and exits at once when its tile lies past the
  sequence's queries (this is how ``q_len == 0`` sequences cost nothing). Grid axis 1 is the
  KV head, axis 2 the KV split.
* **KV walk.** Keys are visited in tiles of ``BLOCK_N`` positions, independent of the cache
  block size: each position is translated through the block table
  (``block_tables[s, pos // block_size]``, offset ``pos % block_size``), so shuffled,
  non-contiguous block tables are fine. Only positions a row of the tile can see are visited:
  up to the tile's last query position (causal) and, with a sliding window, from the first
  query's window start.
* **Masking by absolute position.** Query ``j`` of sequence ``s`` sits at
  ``seq_lens[s] - q_len + j``; key position ``p`` is visible iff ``p <= q_pos`` (and
  ``p > q_pos - sliding_window``). Key tiles that lie wholly at or before the tile's first
  query position skip the mask (unless a window is set); the rest are masked. Online softmax
  runs in fp32 in base 2; fully masked rows are guarded so they produce zeros, never NaN.
* **Split-KV (flash decoding).** With ``num_splits > 1`` each (tile, head) pair's KV range is cut
  into ``num_splits`` contiguous chunks of whole ``BLOCK_N`` tiles, each program writes a
  normalised partial output and its log-sum-exp (fp32), and :func:`_reduce_splits_kernel`
  merges them. :func:`choose_num_splits` documents when this is used.
* **Batch-invariant mode** (``batch_invariant=True``): one configuration for every batch: no
  split-KV, the query tile of a prefill (``BLOCK_M = 64``) for decode too, every key tile
  through the masked code path, and query tiles aligned to absolute positions (tile ``k`` of a
  sequence holds positions ``[k * BLOCK_Q, (k + 1) * BLOCK_Q)``; a sequence gets one more tile
  in the grid for it: ``T[s] = query_start_loc[s] // BLOCK_Q + 2 s``). A query row then meets
  the same operations in the same order whatever shares its tile or its batch and however its
  prompt was chunked: it sits at a place of the tile fixed by its position, its keys are walked
  in ``BLOCK_N`` tiles from position 0 (fixed-size splits of the KV range, merged in order by
  the online softmax), a key tile it cannot see changes nothing exactly (its probabilities are
  0), and ``tl.dot`` has one shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["paged_attention", "paged_attention_split_kv", "choose_num_splits", "device_num_sms"]

#: Split the KV range only when the largest possible context (block-table width * block size)
#: reaches this many tokens; below it the reduction costs more than the parallelism gains.
SPLIT_MIN_CONTEXT = 2048
#: Each split should cover at least this many KV positions.
SPLIT_MIN_TOKENS = 512
#: Upper bound on the number of splits (bounds the partial-result buffers); a power of two.
MAX_SPLITS = 32
#: SM count assumed when no CUDA device is present (tests under the interpreter): an H100/H200.
DEFAULT_NUM_SMS = 132

def choose_num_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, max_context: int,
                      num_sms: int) -> int:
    """How many KV splits the automatic path uses (1 means the single-pass kernel).

    Heuristic, computed from shapes only (no device sync):

    * only decode-only batches split (``num_tokens == num_seqs``): a batch with prefill
      tokens already has many query tiles to spread over the GPU;
    * only when the single-pass grid is too small to fill the GPU, i.e.
      ``num_seqs * num_kv_heads < num_sms``;
    * only when ``max_context >= SPLIT_MIN_CONTEXT``;
    * then ``splits = min(cdiv(2 * num_sms, num_seqs * num_kv_heads),
      max_context // SPLIT_MIN_TOKENS, MAX_SPLITS)``: about two programs per SM, each with at
      least ``SPLIT_MIN_TOKENS`` keys.

    ``max_context`` is the block-table capacity, an upper bound on every ``seq_lens`` entry;
    splits that fall past a sequence's real context find an empty range and finish at once.
    """
    if num_tokens != num_seqs or num_seqs == 0:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= num_sms or max_context < SPLIT_MIN_CONTEXT:
        return 1
    splits = min(triton.cdiv(2 * num_sms, programs), max_context // SPLIT_MIN_TOKENS, MAX_SPLITS)
    return max(1, splits)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` accumulated in fp32; ``IEEE`` keeps fp32 operands exact (no TF32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, start, kv_end, q_pos, table_row, k_cache_ptr, v_cache_ptr, kv_head,
    stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
    offs_d, d_mask, qk_scale, softcap, sliding_window,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr,
):
    """One online-softmax step over key positions ``[start, start + BLOCK_N)``.

    ``MASKED=False`` is only valid when every position is ``< kv_end`` and visible to every row
    (then no causal/window mask and no fully-masked-row guard are needed)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_end
    if MASKED:
        block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        block = tl.load(table_row + offs_n // BLOCK_SIZE).to(tl.int64)
    in_block = offs_n % BLOCK_SIZE
    k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
    v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
    k_mask = d_mask[:, None]
    v_mask = d_mask[None, :]
    if MASKED:
        k_mask = k_mask & n_mask[None, :]
        v_mask = v_mask & n_mask[:, None]
    k = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None] * stride_kd, mask=k_mask,
                other=0.0)  # [HEAD_PAD, BLOCK_N]
    s = _dot(q, k, IEEE) * qk_scale
    if USE_SOFTCAP:
        # softcap * tanh(x / softcap), in base 2; tanh(y) = 1 - 2 / (exp(2y) + 1).
        s = softcap * 1.4426950408889634 * (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0))
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :] * stride_vd, mask=v_mask,
                other=0.0)  # [BLOCK_N, HEAD_PAD]
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


# Arguments that change from step to step are not specialised on (Triton would otherwise compile
# a variant for a value of 1 or a multiple of 16 in the middle of a run).
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "sliding_window"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale, softcap, sliding_window, num_seqs, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    stride_pt, stride_ph, stride_ps,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, ALIGNED: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    pid_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Sequence of this tile: the largest s with query_start_loc[s] // BLOCK_Q + s * (1 + ALIGNED)
    # <= pid_tile (ALIGNED tiles may need one more tile per sequence).
    lo = pid_tile * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid * (1 + ALIGNED)
        go_right = first_tile <= pid_tile
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    # ALIGNED: tiles cover absolute positions [k * BLOCK_Q, (k + 1) * BLOCK_Q), so a query row's
    # place in its tile is fixed by its position, not by where its chunk starts.
    tile_first = (pid_tile - (q_start // BLOCK_Q + seq * (1 + ALIGNED))) * BLOCK_Q
    if ALIGNED:
        tile_first -= context_len % BLOCK_Q
    if tile_first >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    tok = tile_first + offs_m // GROUP_PAD  # query index inside the sequence (< 0: empty slot)
    head_in_group = offs_m % GROUP_PAD
    row_valid = (tok >= 0) & (tok < q_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group
    q_pos = context_len + tok
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_DIM

    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd,
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)

    # Key positions this tile can see: [kv_start, kv_end).
    last_tok = tl.minimum(tile_first + BLOCK_Q, q_len) - 1
    kv_end = context_len + last_tok + 1
    kv_start = kv_end * 0
    if USE_WINDOW:
        kv_start = tl.maximum(context_len + tile_first - sliding_window + 1, 0)
    kv_start = (kv_start // BLOCK_N) * BLOCK_N
    if SPLIT:
        tiles_per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, BLOCK_N), num_splits)
        kv_start = kv_start + split * tiles_per_split * BLOCK_N
        kv_end = tl.minimum(kv_end, kv_start + tiles_per_split * BLOCK_N)

    if USE_SOFTCAP:
        qk_scale = scale / softcap
    else:
        qk_scale = scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Tiles wholly at or before the tile's first query position are visible to every row: no
    # mask there (without a window). The rest (the diagonal, window edges) is masked.
    full_end = kv_start
    if not USE_WINDOW and not ALIGNED:
        first_q_pos = context_len + tile_first
        full_end = tl.minimum(kv_end, tl.maximum(kv_start, (first_q_pos + 1) // BLOCK_N * BLOCK_N))
    for start in range(kv_start, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start, kv_end, q_pos, table_row, k_cache_ptr, v_cache_ptr, kv_head,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
            stride_vd, offs_d, d_mask, qk_scale, softcap, sliding_window,
            BLOCK_N, BLOCK_SIZE, USE_SOFTCAP, USE_WINDOW, False, IEEE)
    for start in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start, kv_end, q_pos, table_row, k_cache_ptr, v_cache_ptr, kv_head,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh,
            stride_vd, offs_d, d_mask, qk_scale, softcap, sliding_window,
            BLOCK_N, BLOCK_SIZE, USE_SOFTCAP, USE_WINDOW, True, IEEE)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    rows = (q_start + tok).to(tl.int64)
    store_mask = row_valid[:, None] & d_mask[None, :]
    if SPLIT:
        part_rows = rows * stride_pt + head * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part_rows[:, None] * HEAD_PAD + offs_d[None, :], o,
                 mask=store_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + part_rows, lse, mask=row_valid)
    else:
        out_rows = rows * stride_ot + head * stride_oh
        tl.store(out_ptr + out_rows[:, None] + offs_d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_pt, stride_ph, stride_ps,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Merge the per-split partial outputs of one (token, head): weights ``2**(lse - max)``."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_mask = offs_s < num_splits
    base = token * stride_pt + head * stride_ph + offs_s * stride_ps
    lse = tl.load(part_lse_ptr + base, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    parts = tl.load(part_out_ptr + base[:, None] * HEAD_PAD + offs_d[None, :],
                    mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    o = tl.sum(parts * w[:, None], 0) / denom
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _check_inputs(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                  sliding_window, softcap, out) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_q_heads, head_dim], got {tuple(query.shape)}.")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}.")
    num_tokens, num_q_heads, head_dim = query.shape
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"key_cache head_dim {key_cache.shape[3]} != query head_dim {head_dim}.")
    if head_dim > 256:
        raise ValueError(f"head_dim must be at most 256, got {head_dim}.")
    num_kv_heads = key_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
    if not query.dtype == key_cache.dtype == value_cache.dtype:
        raise ValueError(f"query, key_cache and value_cache must share one dtype, got "
                         f"{query.dtype}, {key_cache.dtype} and {value_cache.dtype}.")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"query dtype must be float16, bfloat16 or float32, got {query.dtype}.")
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}.")
    if block_tables.dim() != 2 or seq_lens.dim() != 1 or query_start_loc.dim() != 1:
        raise ValueError("block_tables must be 2-D, seq_lens and query_start_loc 1-D.")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries (has "
            f"{query_start_loc.shape[0]}) and block_tables num_seqs = {num_seqs} rows (has "
            f"{block_tables.shape[0]}).")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}.")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}.")
    if out is not None and out.shape != query.shape:
        raise ValueError(f"out must have the query's shape {tuple(query.shape)}, got {tuple(out.shape)}.")


def device_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (``DEFAULT_NUM_SMS`` off CUDA)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


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
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Triton paged attention; see :func:`workbench.kernels.reference.paged_attention`.

    Picks the split-KV (flash-decoding) variant when :func:`choose_num_splits` says so, except
    with ``batch_invariant`` (the module docstring's fixed configuration: a row's result is
    bitwise the same in any batch).
    """
    num_splits = 1 if batch_invariant else choose_num_splits(
        query.shape[0], seq_lens.shape[0], key_cache.shape[2],
        block_tables.shape[1] * key_cache.shape[1], device_num_sms(query.device))
    return paged_attention_split_kv(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
        num_splits=num_splits, sliding_window=sliding_window, softcap=softcap, out=out,
        batch_invariant=batch_invariant)


def paged_attention_split_kv(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Paged attention with an explicit number of KV splits (1: single pass, no reduction).

    Same contract as :func:`paged_attention`; any ``num_splits`` in ``[1, MAX_SPLITS]`` gives the
    same result up to rounding, for any batch (decode or prefill). ``batch_invariant``: one tile
    configuration for every batch (requires ``num_splits == 1``).
    """
    _check_inputs(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                  sliding_window, softcap, out)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}.")
    if batch_invariant and num_splits != 1:
        raise ValueError(f"batch_invariant needs num_splits == 1, got {num_splits}.")
    if out is None:
        out = torch.empty_like(query)
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    # Query tile: decode-only batches need one token per tile; otherwise 64 rows (128 when
    # sequences bring >= 128 new tokens on average), at least 16 rows for tl.dot.
    if batch_invariant:
        block_m = 64
    elif num_tokens == num_seqs:
        block_m = 16
    elif num_tokens >= 128 * num_seqs and head_pad <= 128:
        block_m = 128
    else:
        block_m = 64
    block_m = max(block_m, group_pad)
    block_q = block_m // group_pad
    block_n = 64 if head_pad <= 128 else 32
    num_warps = 8 if block_m >= 128 else 4

    split = num_splits > 1
    if split:
        part_out = torch.empty((num_tokens, num_q_heads, num_splits, head_pad),
                               dtype=torch.float32, device=query.device)
        part_lse = torch.empty((num_tokens, num_q_heads, num_splits), dtype=torch.float32,
                               device=query.device)
        part_strides = part_lse.stride()
    else:
        part_out = part_lse = out  # unused by the single-pass kernel
        part_strides = (0, 0, 0)

    grid = (num_tokens // block_q + num_seqs * (2 if batch_invariant else 1), num_kv_heads,
            num_splits)
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
        out, part_out, part_lse,
        float(scale), float(softcap or 1.0), int(sliding_window or 0), num_seqs, num_splits,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), block_tables.stride(0),
        *out.stride(), *part_strides,
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        USE_SOFTCAP=softcap is not None, USE_WINDOW=sliding_window is not None, SPLIT=split,
        IEEE=query.dtype == torch.float32, ALIGNED=batch_invariant,
        num_warps=num_warps, num_stages=2,
    )
    if split:
        _reduce_splits_kernel[(num_tokens, num_q_heads)](
            part_out, part_lse, out, num_splits, *part_strides, *out.stride(),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad,
            SPLITS_PAD=MAX_SPLITS, num_warps=4,  # one variant for every num_splits
        )
    return out
