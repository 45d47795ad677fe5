"""Correctness checks shared by ``workbench selftest`` (a GPU machine's first run) and the test
suite (the CPU), so a case or a tolerance changed for one holds for both.

Kernels are checked against their torch references (``workbench.kernels.reference``); every
``check_*`` raises ``AssertionError`` (from ``torch.testing.assert_close``) when a kernel is
out of tolerance and returns the largest absolute error otherwise. Greedy tokens are checked
against transformers' ``generate``: :func:`hf_greedy` and :func:`greedy_mismatches`.
"""

from __future__ import annotations

import math
import pathlib
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workbench.kernels import ops
from workbench.kernels import reference, triton_attention
from workbench.model.loader import default_model_path

#: (atol, rtol) of a kernel against its reference, per dtype. bfloat16: Triton casts the
#: softmax probabilities to bf16 for ``tl.dot``, so long contexts need the looser bound.
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.float16: (3e-3, 1e-2),
             torch.bfloat16: (2e-2, 5e-2)}


def tolerance(dtype: torch.dtype) -> dict:
    """``assert_close`` keywords for ``dtype`` (see :data:`TOLERANCE`)."""
    atol, rtol = TOLERANCE[dtype]
    return dict(atol=atol, rtol=rtol)


def _compare(got: torch.Tensor, expected: torch.Tensor, **tol) -> float:
    torch.testing.assert_close(got, expected, **(tol or tolerance(expected.dtype)))
    return (got.float() - expected.float()).abs().max().item() if got.numel() else 0.0


# ----------------------------------------------------------------------------- paged attention

def attention_batches(context: int, prefill: int) -> dict[str, tuple[list[int], list[int]]]:
    """Named ``(query lengths, cached lengths)`` batches: all-decode with ``context`` and
    twice it beside short and block-edge sequences, a mixed step (decode, prefill, chunked
    prefill), a ``prefill``-token prompt beside a short one, and speculative decoding's
    verification step (decodes of 1 + k tokens, causal among themselves, beside a plain
    decode and a chunked prefill)."""
    return {
        "decode": ([1] * 8, [context, 5, 17, 100, 1, 63, 64, 2 * context]),
        "mixed": ([1, 37, 1, 12], [context, 0, 9, 30]),
        "prefill": ([prefill, 20], [0, 0]),
        "spec_decode": ([4, 1, 7, 2, 12], [context, 9, 2 * context - 3, 15, 30]),
    }


def build_batch(q_lens: Sequence[int], ctx_lens: Sequence[int], *, num_kv_heads: int, group: int,
                head_dim: int, block_size: int, dtype: torch.dtype, seed: int,
                device: str | torch.device = "cpu") -> tuple[torch.Tensor, ...]:
    """``(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens)`` of a packed
    batch over a paged cache with shuffled, non-contiguous block tables.

    Sequence s has ``ctx_lens[s]`` cached tokens before its ``q_lens[s]`` new ones. Cache slots
    past each sequence's length, spare blocks and block-table padding (pointing at a spare
    block) are NaN, so a read out of range shows in the output.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # two spare blocks, never referenced by a live slot
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    spare = int(perm[-1])
    width = max(blocks_per_seq + [1]) + 1  # one padding column at least
    block_tables = torch.full((len(q_lens), width), spare, dtype=torch.int32)
    used = 0
    for s, (n_blocks, n_tok) in enumerate(zip(blocks_per_seq, seq_lens)):
        ids = perm[used:used + n_blocks]
        used += n_blocks
        block_tables[s, :n_blocks] = ids.to(torch.int32)
        flat_k = torch.randn(n_tok, num_kv_heads, head_dim, generator=gen).to(dtype)
        flat_v = torch.randn(n_tok, num_kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(n_tok):
            key_cache[ids[pos // block_size], pos % block_size] = flat_k[pos]
            value_cache[ids[pos // block_size], pos % block_size] = flat_v[pos]
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    query = torch.randn(int(qsl[-1]), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    batch = (query, key_cache, value_cache, block_tables, qsl,
             torch.tensor(seq_lens, dtype=torch.int32))
    return tuple(t.to(device) for t in batch)


def check_paged_attention(batch: Sequence[torch.Tensor], *, backend: str,
                          num_splits: int | None = None, sliding_window: int | None = None,
                          softcap: float | None = None, plan=None) -> float:
    """``backend``'s attention on ``batch`` (:func:`build_batch`) against the reference, into a
    NaN-poisoned ``out`` that must come back whole; ``num_splits`` forces Triton's split-KV
    variant with that many splits."""
    query, key_cache, value_cache, block_tables, qsl, seq_lens = batch
    scale = query.shape[-1] ** -0.5
    expected = reference.paged_attention(*batch, scale, sliding_window=sliding_window,
                                         softcap=softcap)
    out = torch.full_like(query, float("nan"))
    if num_splits is None:
        got = ops.paged_attention(*batch, scale, sliding_window=sliding_window,
                                  softcap=softcap, out=out, backend=backend, plan=plan)
    else:
        got = triton_attention.paged_attention_split_kv(
            *batch, scale, num_splits=num_splits, sliding_window=sliding_window,
            softcap=softcap, out=out)
    assert got is out, "the kernel did not write into out"
    assert not out.isnan().any(), "an output element was not written (or read a poisoned slot)"
    return _compare(out, expected)


# ----------------------------------------------------------------------------- the other kernels

def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None, *, backend: str) -> float:
    """RMSNorm (with the residual added first when given): ``x`` and ``residual`` unchanged,
    the new residual bitwise the reference's (one rounding of ``x + residual``)."""
    x_before = x.clone()
    res_before = None if residual is None else residual.clone()
    got = ops.rms_norm(x, weight, eps, residual, backend=backend)
    expected = reference.rms_norm(x, weight, eps, res_before)
    assert torch.equal(x, x_before), "rms_norm changed its input"
    if residual is None:
        return _compare(got, expected)
    _compare(got[1], expected[1], atol=0, rtol=0)
    return _compare(got[0], expected[0])


def check_rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                           cos_sin: torch.Tensor, *, backend: str) -> float:
    """RoPE in place on ``query`` and ``key`` (views of a fused QKV buffer are fine)."""
    q_ref, k_ref = query.clone(), key.clone()
    reference.rotary_embedding(positions, q_ref, k_ref, cos_sin)
    ops.rotary_embedding(positions, query, key, cos_sin, backend=backend)
    return max(_compare(query, q_ref), _compare(key, k_ref))


def check_write_kv_cache(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                         num_blocks: int, block_size: int, *, backend: str,
                         dtype: torch.dtype | None = None) -> None:
    """The KV write into NaN caches of ``dtype`` (default: the key's): bitwise the
    reference's, slot -1 and untouched slots left NaN."""
    shape = (num_blocks, block_size, key.shape[1], key.shape[2])
    caches = [torch.full(shape, float("nan"), dtype=dtype or key.dtype, device=key.device)
              for _ in range(4)]
    ops.write_kv_cache(key, value, caches[0], caches[1], slot_mapping, backend=backend)
    reference.write_kv_cache(key, value, caches[2], caches[3], slot_mapping)
    for got, expected in ((caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(got, expected, atol=0, rtol=0, equal_nan=True)


# ----------------------------------------------------------------------------- greedy parity

def copy_tokenizer(model_dir: pathlib.Path) -> None:
    """Copy the embedded model's tokenizer files (and chat template) into ``model_dir``."""
    for f in default_model_path().iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json",
                                                        "chat_template.jinja"):
            shutil.copy(f, model_dir / f.name)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, *,
              stop_at_eos: bool) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for one prompt alone (an explicit mask: ``generate``
    never guesses padding) and, per position, the gap between its top-2 logits."""
    import transformers

    gen = model.generation_config
    config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens,
        eos_token_id=gen.eos_token_id if stop_at_eos else None,
        pad_token_id=gen.pad_token_id if gen.pad_token_id is not None else 0,
        output_scores=True, return_dict_in_generate=True)
    ids = torch.tensor([prompt_ids], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    gaps = [float(s[0].float().topk(2).values.diff().abs()) for s in out.scores]
    return out.sequences[0, len(prompt_ids):].tolist(), gaps


def generate(engine, prompt_ids: list[list[int]], params) -> list:
    """Every prompt in one batch of ``engine``; each one's CompletionOutput, in order. The
    scheduler's invariants hold after every step and no KV block is left allocated."""
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = out
        engine.scheduler.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks, "blocks leaked"
    return [results[f"r{i}"].outputs[0] for i in range(len(prompt_ids))]


@dataclass
class GreedyParity:
    """How many prompts gave transformers' tokens exactly; ``near_ties``: those whose first
    difference falls where transformers' top-2 logits lie within the tie margin; the rest,
    ``mismatches`` (prompt, position, top-2 gap)."""

    identical: int
    near_ties: int
    mismatches: list[dict]


def greedy_mismatches(ours: Sequence[Sequence[int]], model, prompt_ids: list[list[int]],
                      max_new_tokens: int, *, near_tie: float = 0.0,
                      stop_at_eos: bool = False) -> GreedyParity:
    """Compare the engine's greedy tokens ``ours[i]`` with :func:`hf_greedy` of each prompt;
    a near tie (top-2 gap below ``near_tie``) may differ (bf16 on a GPU)."""
    identical, ties, bad = 0, 0, []
    for i, (mine, ids) in enumerate(zip(ours, prompt_ids)):
        theirs, gaps = hf_greedy(model, ids, max_new_tokens, stop_at_eos=stop_at_eos)
        mine = list(mine)
        first = next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if first is None and len(mine) != len(theirs):
            first = min(len(mine), len(theirs))
        if first is None:
            identical += 1
        elif first < len(gaps) and gaps[first] < near_tie:
            ties += 1
        else:
            bad.append({"prompt": i, "position": first, "ours": mine, "theirs": theirs,
                        "hf_top2_gap": round(gaps[first], 4) if first < len(gaps) else None})
    return GreedyParity(identical, ties, bad)
