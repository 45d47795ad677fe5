"""GPU benchmark of the Triton paged-attention kernel (``workbench bench kernels``).

For each case (bf16, head_dim 128, 32 query heads over 4 KV heads, block size 16, shuffled
block tables): the Triton kernel is checked against :mod:`workbench.kernels.reference`, then
timed with ``triton.testing.do_bench`` (median) beside
``torch.nn.functional.scaled_dot_product_attention`` on the same data laid out contiguously
and, where importable, FlexAttention. Decode rows are judged by achieved memory bandwidth
(unique KV bytes read / time), prefill rows by TFLOP/s (causal work only). Decode rows are also
timed with the split-KV variant switched off (``1-split ms``), to show what the automatic choice
(``splits``) buys. The table is printed and written as Markdown to ``--out``.

Without CUDA the benchmark prints why and exits with status 2: correctness is covered on the CPU
by the interpreter tests (``tests/kernels/test_triton_kernels.py``).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from workbench.kernels import reference, triton_attention

DEFAULT_OUT = pathlib.Path(__file__).with_name("RESULTS.md")
NO_CUDA_MESSAGE = ("no CUDA device: the kernel benchmark needs a GPU; the CPU tests cover "
                   "correctness under TRITON_INTERPRET=1")

#: Peak HBM bandwidth (GB/s) by device-name fragment, for the "% of peak" column.
PEAK_BANDWIDTH_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0}


@dataclass(frozen=True)
class Case:
    """One benchmark batch: sequence s brings ``q_lens[s]`` new tokens after ``ctx_lens[s]``
    cached ones (so its ``seq_len`` is their sum)."""

    name: str
    kind: str  # "decode", "prefill" or "mixed"
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    flex: bool = False  # also time FlexAttention (each shape costs a compile)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(q + c for q, c in zip(self.q_lens, self.ctx_lens))

    @property
    def uniform(self) -> bool:
        """All sequences alike: a dense SDPA / FlexAttention batch can run the same work."""
        return len(set(self.q_lens)) == 1 and len(set(self.ctx_lens)) == 1


def decode(batch: int, context: int, flex: bool = False) -> Case:
    return Case(f"decode b={batch} ctx={context}", "decode", (1,) * batch, (context - 1,) * batch,
                flex)


def prefill(batch: int, length: int, cached: int = 0, flex: bool = False) -> Case:
    name = f"prefill b={batch} len={length}" + (f" +{cached} cached" if cached else "")
    return Case(name, "prefill", (length,) * batch, (cached,) * batch, flex)


def mixed(num_prefill: int, length: int, num_decode: int, context: int) -> Case:
    return Case(f"mixed {num_prefill}x{length} + {num_decode} decodes ctx={context}", "mixed",
                (length,) * num_prefill + (1,) * num_decode,
                (0,) * num_prefill + (context - 1,) * num_decode)


#: FlexAttention only on a few shapes: its compile per shape dominates the run time.
DEFAULT_CASES = (
    decode(1, 512), decode(1, 8192), decode(1, 32768, flex=True), decode(4, 32768),
    decode(16, 16384, flex=True), decode(64, 4096), decode(256, 512), decode(256, 4096, flex=True),
    prefill(1, 2048), prefill(4, 4096, flex=True), prefill(2, 1024, cached=3072, flex=True),
    mixed(2, 1024, 126, 2048),
)


@dataclass(frozen=True)
class Shape:
    num_q_heads: int = 32
    num_kv_heads: int = 4
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16


def attention_bytes(case: Case, shape: Shape) -> int:
    """Unique bytes the attention must move: every cached K and V element once, the queries
    read and the outputs written once."""
    elem = torch.finfo(shape.dtype).bits // 8
    kv = 2 * sum(case.seq_lens) * shape.num_kv_heads * shape.head_dim
    qo = 2 * sum(case.q_lens) * shape.num_q_heads * shape.head_dim
    return (kv + qo) * elem


def attention_flops(case: Case, shape: Shape) -> int:
    """Causal matmul FLOPs: query j of a sequence with c cached tokens sees c + j + 1 keys, and
    costs 2 * head_dim FLOPs per key for Q K^T and as many for P V, per query head."""
    visible = sum(q * c + q * (q + 1) // 2 for q, c in zip(case.q_lens, case.ctx_lens))
    return 4 * shape.head_dim * shape.num_q_heads * visible


def build_inputs(case: Case, shape: Shape, device: str, seed: int = 0) -> dict:
    """Random paged cache with shuffled block tables, and the queries of the packed batch."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bs = shape.block_size
    blocks = [math.ceil(n / bs) for n in case.seq_lens]
    num_blocks = sum(blocks)
    cache_shape = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=shape.dtype)
    value_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=shape.dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    block_tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for s, n in enumerate(blocks):
        block_tables[s, :n] = perm[start:start + n]
        start += n
    qsl = torch.zeros(len(blocks) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(case.q_lens).cumsum(0)
    query = torch.randn(int(qsl[-1]), shape.num_q_heads, shape.head_dim, generator=gen,
                        device=device, dtype=shape.dtype)
    return dict(query=query, key_cache=key_cache, value_cache=value_cache,
                block_tables=block_tables, query_start_loc=qsl.to(device),
                seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device))


def dense_inputs(case: Case, shape: Shape, inputs: dict):
    """The same data as [batch, heads, len, head_dim] tensors (K/V gathered contiguously)."""
    batch, q_len, seq_len = len(case.q_lens), case.q_lens[0], case.seq_lens[0]
    q = inputs["query"].view(batch, q_len, shape.num_q_heads, shape.head_dim).transpose(1, 2)
    bt = inputs["block_tables"].long()

    def gather(cache):
        flat = cache[bt].flatten(1, 2)[:, :seq_len]  # [batch, seq_len, kv_heads, head_dim]
        return flat.transpose(1, 2).contiguous()

    return q.contiguous(), gather(inputs["key_cache"]), gather(inputs["value_cache"])


def sdpa_fn(case: Case, shape: Shape, inputs: dict) -> Callable[[], torch.Tensor]:
    """SDPA (backend chosen by torch) on the same batch; causal aligned to the last key."""
    import torch.nn.functional as F

    q, k, v = dense_inputs(case, shape, inputs)
    scale = shape.head_dim ** -0.5
    if case.q_lens[0] == 1:
        return lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    if case.ctx_lens[0] == 0:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                      enable_gqa=True)
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[2], k.shape[2])
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                  enable_gqa=True)


def flex_fn(case: Case, shape: Shape, inputs: dict) -> Callable[[], torch.Tensor]:
    """Compiled FlexAttention on the same batch, causal mask as a block mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = dense_inputs(case, shape, inputs)
    offset = case.ctx_lens[0]

    def causal(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=q.shape[2], KV_LEN=k.shape[2],
                                   device=q.device)
    flex = torch.compile(flex_attention, dynamic=False)
    return lambda: flex(q, k, v, block_mask=block_mask, scale=shape.head_dim ** -0.5,
                        enable_gqa=True)


def _fmt(value, digits=3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def format_table(rows: list[dict], markdown: bool) -> str:
    """Rows of equal keys as an aligned plain-text table or a Markdown table."""
    if not rows:
        return ""
    cols = list(rows[0])
    cells = [[_fmt(r[c]) for c in cols] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _time_peer(name: str, case: Case, time_ms: Callable, make: Callable) -> float | None:
    """Time a peer implementation; None (a dash in the table) when this torch cannot run it."""
    try:
        return time_ms(make())
    except Exception as exc:  # missing API, unsupported shape or backend, compile failure
        print(f"  {name} skipped for {case.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def run_case(case: Case, shape: Shape, device: str, time_ms: Callable[[Callable], float], *,
             use_flex: bool, peak_gbs: float | None) -> dict:
    """Check one case against the reference, then time Triton (auto and single-pass), SDPA
    and FlexAttention. Returns one table row."""
    inputs = build_inputs(case, shape, device)
    scale = shape.head_dim ** -0.5
    args = (inputs["query"], inputs["key_cache"], inputs["value_cache"], inputs["block_tables"],
            inputs["query_start_loc"], inputs["seq_lens"], scale)
    out = torch.full_like(inputs["query"], float("nan"))
    triton_attention.paged_attention(*args, out=out)
    expected = reference.paged_attention(*args)
    err = (out.float() - expected.float()).abs().max().item()
    del expected
    splits = triton_attention.choose_num_splits(
        inputs["query"].shape[0], len(case.q_lens), shape.num_kv_heads,
        inputs["block_tables"].shape[1] * shape.block_size,
        triton_attention.device_num_sms(inputs["query"].device))

    t_auto = time_ms(lambda: triton_attention.paged_attention(*args, out=out))
    t_single = None
    if splits > 1:
        t_single = time_ms(lambda: triton_attention.paged_attention_split_kv(
            *args, num_splits=1, out=out))
    t_sdpa = t_flex = None
    if case.uniform:
        t_sdpa = _time_peer("SDPA", case, time_ms, lambda: sdpa_fn(case, shape, inputs))
        if use_flex and case.flex:
            t_flex = _time_peer("FlexAttention", case, time_ms,
                                lambda: flex_fn(case, shape, inputs))
    gbs = attention_bytes(case, shape) / (t_auto * 1e-3) / 1e9
    tflops = attention_flops(case, shape) / (t_auto * 1e-3) / 1e12
    return {
        "case": case.name,
        "max abs err": err,
        "splits": splits,
        "triton ms": t_auto,
        "1-split ms": t_single,
        "GB/s": gbs,
        "% peak BW": 100 * gbs / peak_gbs if peak_gbs and case.kind == "decode" else None,
        "TFLOP/s": tflops,
        "SDPA ms": t_sdpa,
        "SDPA TFLOP/s": attention_flops(case, shape) / (t_sdpa * 1e-3) / 1e12 if t_sdpa else None,
        "flex ms": t_flex,
        "triton vs SDPA": t_sdpa / t_auto if t_sdpa else None,
    }


def check_layer_kernels(device: str) -> dict[str, float]:
    """write_kv_cache, rms_norm and rotary_embedding in bf16 at model shapes vs the reference
    (bf16 cannot be checked on the CPU: the interpreter's bf16 is not trusted). Max abs errors."""
    from workbench.kernels import triton_cache, triton_norm, triton_rope

    gen = torch.Generator(device=device).manual_seed(1)
    dt = torch.bfloat16
    errors = {}
    key = torch.randn(512, 8, 128, generator=gen, device=device, dtype=dt)
    value = torch.randn_like(key)
    slots = torch.randperm(64 * 16, generator=gen, device=device)[:512]
    slots[::7] = -1
    caches = [torch.zeros(64, 16, 8, 128, device=device, dtype=dt) for _ in range(4)]
    triton_cache.write_kv_cache(key, value, caches[0], caches[1], slots)
    reference.write_kv_cache(key, value, caches[2], caches[3], slots)
    errors["write_kv_cache"] = max((caches[0] - caches[2]).abs().max().item(),
                                   (caches[1] - caches[3]).abs().max().item())
    x = torch.randn(512, 4096, generator=gen, device=device, dtype=dt)
    res = torch.randn_like(x)
    w = torch.randn(4096, generator=gen, device=device, dtype=dt)
    got, got_res = triton_norm.rms_norm(x, w, 1e-6, res)
    exp, exp_res = reference.rms_norm(x, w, 1e-6, res)
    errors["rms_norm"] = max((got - exp).abs().max().item(),
                             (got_res - exp_res).abs().max().item())
    q = torch.randn(512, 32, 128, generator=gen, device=device, dtype=dt)
    k = torch.randn(512, 8, 128, generator=gen, device=device, dtype=dt)
    inv = 1.0 / 10000 ** (torch.arange(0, 128, 2, device=device).float() / 128)
    freqs = torch.arange(4096, device=device).float()[:, None] * inv
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    pos = torch.randint(0, 4096, (512,), generator=gen, device=device)
    q2, k2 = q.clone(), k.clone()
    triton_rope.rotary_embedding(pos, q, k, cos_sin)
    reference.rotary_embedding(pos, q2, k2, cos_sin)
    errors["rotary_embedding"] = max((q - q2).abs().max().item(), (k - k2).abs().max().item())
    return errors


#: Largest accepted max abs error against the fp32-math reference, bf16 inputs and outputs.
ATTENTION_TOLERANCE = 3e-2
LAYER_TOLERANCE = 6e-2


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every correctness check passed, 1 otherwise, 2 without CUDA."""
    parser = argparse.ArgumentParser(prog="workbench bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                        help=f"Markdown results file (default {DEFAULT_OUT})")
    parser.add_argument("--no-flex", action="store_true",
                        help="skip FlexAttention (it compiles once per shape)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        return 2
    import triton.testing

    device = "cuda"
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BANDWIDTH_GBS.items() if k in name), None)
    shape = Shape()

    def time_ms(fn: Callable) -> float:
        fn()  # compile / autotune outside the timed runs
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    started = time.perf_counter()
    layer_errors = check_layer_kernels(device)
    rows = []
    for case in DEFAULT_CASES:
        rows.append(run_case(case, shape, device, time_ms, use_flex=not args.no_flex,
                             peak_gbs=peak))
        print(f"  {case.name}: {rows[-1]['triton ms']:.3f} ms", file=sys.stderr)
        torch.cuda.empty_cache()
    ok = (all(r["max abs err"] <= ATTENTION_TOLERANCE for r in rows)
          and all(e <= LAYER_TOLERANCE for e in layer_errors.values()))
    header = (f"Paged attention on {name} (torch {torch.__version__}, triton "
              f"{triton.__version__}): bf16, {shape.num_q_heads} q heads / "
              f"{shape.num_kv_heads} kv heads, head_dim {shape.head_dim}, block size "
              f"{shape.block_size}; median of triton.testing.do_bench; "
              f"peak bandwidth assumed {peak or 'unknown'} GB/s.")
    layer_line = "Layer kernels vs reference (bf16, max abs err): " + ", ".join(
        f"{k} {v:.3g}" for k, v in layer_errors.items())
    verdict = "all correctness checks passed" if ok else "CORRECTNESS CHECK FAILED"
    print(header)
    print(format_table(rows, markdown=False))
    print(layer_line)
    print(f"{verdict} ({time.perf_counter() - started:.0f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        "# Kernel benchmark results\n\nWritten by `workbench bench kernels`.\n\n"
        f"{header}\n\nDecode rows: judge `GB/s` (unique K/V bytes / time) and `% peak BW`. "
        "Prefill rows: judge `TFLOP/s` (causal work only) against SDPA. `splits`: KV splits "
        "the automatic heuristic chose; `1-split ms`: the same batch forced to one pass. "
        "`triton vs SDPA` > 1 means Triton is faster.\n\n"
        f"{format_table(rows, markdown=True)}\n\n{layer_line}\n\n{verdict}\n")
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
