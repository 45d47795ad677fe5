"""The Triton kernels compile for a real GPU (sm_90, Hopper), with no GPU present.

The interpreter accepts things real compilation rejects (``tl.dot`` tiles under 16, shapes that
are not powers of two, type mismatches in loops), so each kernel is compiled ahead of time for
``GPUTarget("cuda", 90, 32)`` down to a cubin with the ``ptxas`` shipped in the Triton wheel, in
a subprocess where ``TRITON_INTERPRET`` is unset. The configurations are those the launchers
pick for decode, prefill, split-KV and the odd head sizes.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")

PTXAS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from workbench.kernels import triton_attention as ta, triton_cache, triton_norm, triton_rope

    def compile_for_sm90(fn, types, consts, num_warps=4, num_stages=2):
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        kernel = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
        assert kernel.asm["cubin"], fn.__name__

    for dt in ("bf16", "fp32"):  # bf16: what GPUs run; fp32: the IEEE tl.dot path
        attn = {n: "*" + dt for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
        attn.update({n: "*i32" for n in ("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr")})
        attn.update(part_out_ptr="*fp32", part_lse_ptr="*fp32", scale="fp32", softcap="fp32")
        # (head_dim, group, block_q, split, softcap, window, num_warps): decode group 8, a
        # 128-row prefill tile, split-KV with head 80, head 32 and 96 with window/softcap.
        for hd, g, bq, split, cap, win, warps in [(128, 8, 2, False, False, False, 4),
                                                  (128, 8, 16, False, True, True, 8),
                                                  (80, 4, 4, True, False, False, 4),
                                                  (32, 1, 64, False, False, True, 4),
                                                  (96, 2, 32, True, True, False, 4)]:
            if dt == "fp32" and hd != 128:
                continue  # fp32 (IEEE dot) checked on the two head-128 tiles only
            gp = triton.next_power_of_2(g)
            compile_for_sm90(ta._paged_attention_kernel, attn, dict(
                HEAD_DIM=hd, HEAD_PAD=max(16, triton.next_power_of_2(hd)), GROUP=g,
                GROUP_PAD=gp, BLOCK_Q=bq, BLOCK_N=64, BLOCK_SIZE=16, USE_SOFTCAP=cap,
                USE_WINDOW=win, SPLIT=split, IEEE=dt == "fp32", ALIGNED=False), num_warps=warps)
        # batch-invariant mode: the 64-row tile for every batch, tiles aligned to positions
        compile_for_sm90(ta._paged_attention_kernel, attn, dict(
            HEAD_DIM=128, HEAD_PAD=128, GROUP=8, GROUP_PAD=8, BLOCK_Q=8, BLOCK_N=64,
            BLOCK_SIZE=16, USE_SOFTCAP=False, USE_WINDOW=True, SPLIT=False, IEEE=dt == "fp32",
            ALIGNED=True), num_warps=4)
        if dt == "fp32":
            continue  # the other kernels have no dtype-specific code paths
        compile_for_sm90(ta._reduce_splits_kernel,
                         dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*" + dt),
                         dict(HEAD_DIM=80, HEAD_PAD=128, SPLITS_PAD=8))
        compile_for_sm90(triton_cache._write_kv_cache_kernel,
                         dict(key_ptr="*" + dt, value_ptr="*" + dt, key_cache_ptr="*" + dt,
                              value_cache_ptr="*" + dt, slot_mapping_ptr="*i64"),
                         dict(NUM_HEADS=8, HEADS_PAD=8, HEAD_DIM=80, HEAD_PAD=128, BLOCK_SIZE=16))
        compile_for_sm90(triton_norm._rms_norm_kernel,
                         dict(x_ptr="*" + dt, residual_ptr="*" + dt, weight_ptr="*fp32",
                              out_ptr="*" + dt, residual_out_ptr="*" + dt, eps="fp32"),
                         dict(HIDDEN=4096, BLOCK=4096, HAS_RESIDUAL=True), num_warps=16)
        compile_for_sm90(triton_rope._rope_kernel,
                         dict(positions_ptr="*i64", q_ptr="*" + dt, k_ptr="*" + dt,
                              cos_sin_ptr="*fp32"),
                         dict(NUM_Q_HEADS=28, Q_HEADS_PAD=32, NUM_K_HEADS=4, K_HEADS_PAD=4,
                              HALF=40, HALF_PAD=64))
    print("compiled")
""")


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton wheel ships no ptxas")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "compiled" in result.stdout
