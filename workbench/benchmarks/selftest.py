"""``workbench selftest``: a bounded first run on a new machine (written for one CUDA GPU).

Installs nothing and needs no network. Each step runs in its own process under a time limit
carved from one budget (default 540 s: the whole check stays under 9 minutes); a step that no
longer fits is skipped, a step that crashes or hangs is reported and the next one runs.

1. ``env``        versions, device, free memory; the engine and kernels import with fastapi,
                  uvicorn and ipywidgets blocked (the GPU box has none of them).
2. ``kernels``    every kernel against its torch reference (``workbench.kernels.reference``;
                  cases and checks from ``workbench.benchmarks.checks``, which the tests run too):
                  paged attention (decode, mixed, prefill, split-KV, sliding window), KV write,
                  RMSNorm (with and without residual), RoPE; fp32/fp16/bf16 at the embedded
                  model's and Qwen3-0.6B's head shapes (CPU: the Triton interpreter, fp32 only,
                  and the "cpu" backend).
3. ``parity``     greedy tokens against transformers (``checks.greedy_mismatches``, as the
                  tests): the embedded model in fp32 (identical),
                  and a Qwen3-0.6B-shaped model with random weights in bf16 on CUDA (a mismatch
                  is a near tie when transformers' top-2 logits there differ by < 0.15).
4. ``throughput`` ``workbench bench throughput --compare hf`` with dummy Qwen3-0.6B-shaped
                  weights; on CUDA it also counts Triton compilations after the engine's warm-up.
5. ``bench-kernels`` ``workbench bench kernels`` (CUDA only).

``--small`` shrinks every shape and workload (what CI runs on a CPU). Results: ``OUT/selftest.json``
(one row per check) and ``OUT/selftest.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

STEPS = ("env", "kernels", "parity", "throughput", "bench-kernels")
#: (time cap in seconds, least time worth starting it with) per step.
STEP_LIMITS = {"env": (60, 10), "kernels": (150, 30), "parity": (120, 30), "throughput": (240, 60),
               "bench-kernels": (150, 60)}
BLOCKED_EXTRAS = ("fastapi", "uvicorn", "ipywidgets")


def qwen3_config(small: bool) -> dict:
    """Qwen/Qwen3-0.6B's config.json (no eos: nothing stops early); ``small`` shrinks it."""
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
           "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
           "max_position_embeddings": 4096, "num_attention_heads": 16, "num_hidden_layers": 28,
           "num_key_value_heads": 8, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "tie_word_embeddings": True, "vocab_size": 151936, "bos_token_id": None,
           "eos_token_id": None, "torch_dtype": "bfloat16"}
    if small:
        cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=4096, max_position_embeddings=512)
    return cfg


def model_dir(work: pathlib.Path, cfg: dict) -> pathlib.Path:
    """A model directory: ``cfg`` + the embedded model's tokenizer files."""
    from workbench.benchmarks.checks import copy_tokenizer

    d = work / "qwen3-shape"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    copy_tokenizer(d)
    return d


class Recorder:
    """Appends one JSON row per check to a file, and prints it."""

    def __init__(self, path: pathlib.Path, step: str):
        self.path, self.step = path, step

    def __call__(self, name: str, ok: bool | None, **data) -> None:
        row = {"step": self.step, "name": name, "ok": ok, **data}
        print({True: "PASS", False: "FAIL", None: "INFO"}[ok], json.dumps(row, default=str), flush=True)
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")


# ------------------------------------------------------------------------------------ steps

def step_env(rec: Recorder, device: str, small: bool, work: pathlib.Path) -> None:
    import importlib
    import platform

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "transformers", "tokenizers", "safetensors", "numpy"):
        try:
            info[mod] = importlib.import_module(mod).__version__
        except ImportError:
            info[mod] = "absent"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    sms=props.multi_processor_count, free_gib=round(free / 2**30, 1),
                    total_gib=round(total / 2**30, 1))
    rec("versions and device", None, **info)
    blocker = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {BLOCKED_EXTRAS!r}:\n"
        "            raise ImportError(f'{name} is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import workbench.engine.llm_engine, workbench.worker.model_runner, workbench.kernels, workbench.entrypoints.llm\n"
        "from workbench.kernels import cpu_attention, reference\n"
        "from workbench import LLM, LLMEngine, SamplingParams\n"
        "print('imports ok')\n")
    proc = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120)
    rec(f"engine and kernels import without {', '.join(BLOCKED_EXTRAS)}", proc.returncode == 0,
        stderr=proc.stderr[-600:])


def _record_check(rec: Recorder, name: str, check, *args, **kwargs) -> None:
    """Run one shared check (``workbench.benchmarks.checks``): PASS with its error, or FAIL
    with the assertion's message."""
    try:
        err = check(*args, **kwargs)
    except AssertionError as exc:
        rec(name, False, error=str(exc)[:600])
    else:
        rec(name, True, **({} if err is None else {"max_abs_err": err}))


def step_kernels(rec: Recorder, device: str, small: bool, work: pathlib.Path) -> None:
    import torch

    from workbench.benchmarks import checks

    dtypes = [torch.float32, torch.float16, torch.bfloat16] if device == "cuda" else [torch.float32]
    backends = ["triton"] if device == "cuda" else ["triton", "cpu"]
    # (name, kv heads, group, head_dim): the embedded model and Qwen3-0.6B
    shapes = [("tiny-shakespeare", 3, 2, 32), ("qwen3-0.6b", 8, 2, 128)]
    if small:
        shapes = [("tiny-shakespeare", 3, 2, 32), ("qwen3-like", 2, 2, 64)]
    # a long context takes the split-KV path on a GPU
    batches = checks.attention_batches(40, 70) if small else checks.attention_batches(3000, 700)
    gen = torch.Generator().manual_seed(0)
    for seed, ((shape, kvh, group, hd), dtype, backend) in enumerate(
            (s, d, b) for s in shapes for d in dtypes for b in backends):
        label = f"{shape} {str(dtype)[6:]} {backend}"
        for kind, (q_lens, c_lens) in batches.items():
            batch = checks.build_batch(q_lens, c_lens, num_kv_heads=kvh, group=group, head_dim=hd,
                                       block_size=16, dtype=dtype, seed=seed, device=device)
            for window in (None, 48):
                _record_check(rec, f"paged_attention {kind} window={window} [{label}]",
                              checks.check_paged_attention, batch, backend=backend,
                              sliding_window=window)
        n_tok = 33
        x = torch.randn(n_tok, kvh * group * hd, generator=gen).to(dtype).to(device)
        w = torch.randn(kvh * group * hd, generator=gen).to(dtype).to(device)
        r = torch.randn_like(x)
        _record_check(rec, f"rms_norm [{label}]", checks.check_rms_norm, x, w, 1e-6,
                      backend=backend)
        _record_check(rec, f"rms_norm +residual [{label}]", checks.check_rms_norm, x, w, 1e-6, r,
                      backend=backend)
        pos = torch.randint(0, 500, (n_tok,), generator=gen).to(device)
        cos_sin = torch.randn(512, hd, generator=gen).to(device)
        qr = torch.randn(n_tok, kvh * group, hd, generator=gen).to(dtype).to(device)
        kr = torch.randn(n_tok, kvh, hd, generator=gen).to(dtype).to(device)
        _record_check(rec, f"rotary_embedding [{label}]", checks.check_rotary_embedding, pos,
                      qr.clone(), kr.clone(), cos_sin, backend=backend)
        slots = torch.randperm(320, generator=gen)[:n_tok].to(device)
        slots[3] = -1
        _record_check(rec, f"write_kv_cache [{label}]", checks.check_write_kv_cache, kr, kr * 2,
                      slots, 20, 16, backend=backend)


def _compare_greedy(rec, label, engine, hf, prompts, n, near_tie):
    from workbench import SamplingParams
    from workbench.benchmarks.checks import generate, greedy_mismatches

    outs = generate(engine, prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    parity = greedy_mismatches([o.token_ids for o in outs], hf, prompts, n, near_tie=near_tie)
    rec(f"greedy parity vs transformers: {label}", not parity.mismatches,
        identical=f"{parity.identical}/{len(prompts)}", near_ties=parity.near_ties,
        mismatches=parity.mismatches[:5])


def step_parity(rec: Recorder, device: str, small: bool, work: pathlib.Path) -> None:
    import torch
    import transformers

    from workbench import LLMEngine
    from workbench.model.loader import default_model_path

    g = torch.Generator().manual_seed(0)
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    engine = LLMEngine(model=str(path), dtype="float32", device=device, num_kv_blocks=256,
                       max_num_seqs=8, max_num_batched_tokens=256)
    lens = [5, 17, 40, 64, 100, 3] if not small else [5, 17, 40]
    prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in lens]
    _compare_greedy(rec, f"embedded model fp32 [{engine.attention_backend}]", engine, hf, prompts,
                    12 if small else 32, near_tie=0.0)
    del engine, hf
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    d = model_dir(work, qwen3_config(small))
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.from_pretrained(d)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    hf.save_pretrained(d)
    hf = hf.to(device).eval()
    engine = LLMEngine(model=str(d), dtype=str(dtype)[6:], device=device, num_kv_blocks=512,
                       max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024 if not small else 256)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
               for n in ([16, 40, 77, 128, 200, 300] if not small else [9, 30])]
    _compare_greedy(rec, f"Qwen3-shaped random weights {str(dtype)[6:]} [{engine.attention_backend}]",
                    engine, hf, prompts, 8 if small else 24, near_tie=0.15 if dtype == torch.bfloat16 else 1e-3)


def _compiled_variants() -> int:
    """Compiled variants of every Triton kernel in this process (0 without a compile cache)."""
    from workbench.kernels import triton_attention, triton_cache, triton_norm, triton_rope

    total = 0
    for mod in (triton_attention, triton_cache, triton_norm, triton_rope):
        for obj in vars(mod).values():
            caches = getattr(obj, "device_caches", None) or getattr(obj, "cache", None)
            if isinstance(caches, dict):
                for entry in caches.values():
                    first = entry[0] if isinstance(entry, tuple) else entry
                    total += len(first) if isinstance(first, dict) else 0
    return total


def step_throughput(rec: Recorder, device: str, small: bool, work: pathlib.Path) -> None:
    from workbench.benchmarks import throughput as bench_throughput

    d = model_dir(work, qwen3_config(small))
    out = work / "throughput.json"
    if small:
        workload = ["--num-prompts", "4", "--input-len-range", "4:12", "--output-len-range", "2:6",
                    "--hf-batch-sizes", "4"]
    else:
        workload = ["--num-prompts", "256", "--input-len-range", "100:1024", "--output-len-range",
                    "128:128", "--hf-batch-sizes", "64,256", "--dtype", "bfloat16"]
    argv = ["--model", str(d), "--load-format", "dummy", "--device", device, "--compare", "hf",
            "--output-json", str(out), *workload]
    rc = bench_throughput.main(argv)
    data = json.loads(out.read_text()) if out.exists() else {"results": []}
    by = {r["engine"]: r for r in data["results"]}
    ours = by.get("workbench", {}).get("output_tokens_per_s")
    for name, r in by.items():
        ratio = round(ours / r["output_tokens_per_s"], 2) if ours else None
        rec(f"bench throughput: {name}", rc == 0 if name == "workbench" else None,
            output_tokens=r["output_tokens"], output_tokens_per_s=r["output_tokens_per_s"],
            total_s=round(r["total_s"], 2),
            workbench_over_it=ratio, details=r["details"])
    if device == "cuda":
        rec_compiles(rec, d)


def rec_compiles(rec: Recorder, d: pathlib.Path) -> None:
    """Triton compilations during a run after the engine's warm-up: must be none."""
    import random

    from workbench import LLM, SamplingParams

    llm = LLM(model=str(d), load_format="dummy", dtype="bfloat16", max_model_len=4096)
    after_warmup = _compiled_variants()
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000) for _ in range(rng.randint(1, 900))]} for _ in range(64)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 64), ignore_eos=True) for _ in prompts]
    llm.generate(prompts, params, use_tqdm=False)
    rec("no Triton compilation after the engine's warm-up", _compiled_variants() == after_warmup,
        variants_after_warmup=after_warmup, variants_after_run=_compiled_variants())


def step_bench_kernels(rec: Recorder, device: str, small: bool, work: pathlib.Path) -> None:
    from workbench.kernels import bench

    out = work / "kernels_bench.md"
    rc = bench.main(["--out", str(out)])
    rec("bench kernels", rc == 0, table=out.read_text() if out.exists() else None)


STEP_FUNCTIONS = {"env": step_env, "kernels": step_kernels, "parity": step_parity,
                  "throughput": step_throughput, "bench-kernels": step_bench_kernels}


# ------------------------------------------------------------------------------------ driver

def _markdown(rows: list[dict], steps: list[dict]) -> str:
    lines = ["# workbench selftest", "", "| step | status | seconds | note |", "|---|---|---:|---|"]
    lines += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s.get('note', '')} |" for s in steps]
    lines += ["", "| step | check | result | data |", "|---|---|---|---|"]
    for r in rows:
        data = {k: v for k, v in r.items() if k not in ("step", "name", "ok", "table")}
        verdict = {True: "PASS", False: "**FAIL**", None: "info"}[r["ok"]]
        lines.append(f"| {r['step']} | {r['name']} | {verdict} | `{json.dumps(data, default=str)[:300]}` |")
    for r in rows:
        if r.get("table"):
            lines += ["", "## bench kernels", "", r["table"]]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The selftest's options (shared by ``python -m workbench.benchmarks.selftest`` and ``workbench selftest``)."""
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--small", action="store_true", help="tiny shapes and workloads (CI on a CPU)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("selftest-out"))
    parser.add_argument("--budget-s", type=float, default=540.0, help="time for all steps (default 540)")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    parser.add_argument("--run-step", default=None, help=argparse.SUPPRESS)  # internal: one step, in-process


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbench selftest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the steps of ``args`` (see :func:`add_arguments`); 0 when every check passed."""
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "selftest.jsonl"
    if args.run_step:
        with tempfile.TemporaryDirectory() as work:
            STEP_FUNCTIONS[args.run_step](Recorder(rows_path, args.run_step), args.device, args.small,
                                          pathlib.Path(work))
        return 0
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        print(f"error: unknown step(s) {unknown}; steps are {', '.join(STEPS)}", file=sys.stderr)
        return 2
    rows_path.write_text("")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # the Triton kernels through the interpreter
    start = time.monotonic()
    summary = []
    for step in steps:
        cap, least = STEP_LIMITS[step]
        left = args.budget_s - (time.monotonic() - start)
        if step == "bench-kernels" and args.device != "cuda":
            summary.append({"step": step, "status": "SKIPPED", "seconds": 0, "note": "CUDA only"})
            continue
        if left < least:
            summary.append({"step": step, "status": "SKIPPED", "seconds": 0,
                            "note": f"{left:.0f} s of the budget left"})
            continue
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "workbench.benchmarks.selftest", "--run-step", step, "--device", args.device,
               "--out", str(args.out)] + (["--small"] if args.small else [])
        try:
            proc = subprocess.run(cmd, env=env, timeout=min(cap, left), capture_output=True, text=True)
            status = "PASS" if proc.returncode == 0 else "FAIL"
            note = "" if proc.returncode == 0 else proc.stderr.strip()[-400:].replace("\n", " ")
            (args.out / f"{step}.log").write_text(proc.stdout + proc.stderr)
        except subprocess.TimeoutExpired:
            status, note = "TIMEOUT", f"killed after {min(cap, left):.0f} s"
        summary.append({"step": step, "status": status, "seconds": round(time.monotonic() - t0, 1),
                        "note": note})
        print(f"[{step}] {status} in {summary[-1]['seconds']} s {note}", flush=True)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line]
    failed = [r for r in rows if r["ok"] is False] + [s for s in summary if s["status"] in ("FAIL", "TIMEOUT")]
    report = {"device": args.device, "small": args.small, "seconds": round(time.monotonic() - start, 1),
              "steps": summary, "checks": rows, "failed": len(failed)}
    (args.out / "selftest.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "selftest.md").write_text(_markdown(rows, summary))
    print(f"{len(rows)} checks, {len(failed)} failed; {args.out / 'selftest.json'}, {args.out / 'selftest.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
