"""``workbench selftest``: a bounded first run on a new machine (written for one CUDA GPU).

Installs nothing and needs no network. Each step runs in its own process under a time limit
carved from one budget (default 540 s: the whole check stays under 9 minutes); a step that no
longer fits is skipped, a step that crashes or hangs is reported and the next one runs.

1. ``env``        versions, device, free memory; the engine and kernels import with fastapi,
                  uvicorn and ipywidgets blocked (the GPU box has none of them).
2. ``kernels``    every kernel against its torch reference (``workbench.kernels.reference``):
                  paged attention (decode, mixed, prefill, split-KV, sliding window), KV write,
                  RMSNorm (with and without residual), RoPE; fp32/fp16/bf16 at the embedded
                  model's and Qwen3-0.6B's head shapes (CPU: the Triton interpreter, fp32 only,
                  and the "cpu" backend).
3. ``parity``     greedy tokens against transformers: the embedded model in fp32 (identical),
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
    import shutil

    from workbench.model.loader import default_model_path

    d = work / "qwen3-shape"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    for f in default_model_path().iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, d / f.name)
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


def _close(got, expected, dtype) -> tuple[bool, float]:
    import torch

    tol = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 1e-2), torch.bfloat16: (2e-2, 5e-2)}[dtype]
    err = (got.float() - expected.float()).abs().max().item() if got.numel() else 0.0
    ok = bool(torch.allclose(got.float(), expected.float(), atol=tol[0], rtol=tol[1]))
    return ok and not got.isnan().any().item(), err


def step_kernels(rec: Recorder, device: str, small: bool, work: pathlib.Path) -> None:
    import math

    import torch

    from workbench import kernels
    from workbench.kernels import reference

    dtypes = [torch.float32, torch.float16, torch.bfloat16] if device == "cuda" else [torch.float32]
    backends = ["triton"] if device == "cuda" else ["triton", "cpu"]
    # (name, kv heads, group, head_dim): the embedded model and Qwen3-0.6B
    shapes = [("tiny-shakespeare", 3, 2, 32), ("qwen3-0.6b", 8, 2, 128)]
    if small:
        shapes = [("tiny-shakespeare", 3, 2, 32), ("qwen3-like", 2, 2, 64)]
    ctx = 40 if small else 3000  # long context: the split-KV path on a GPU
    gen = torch.Generator().manual_seed(0)
    for (shape, kvh, group, hd), dtype, backend in (
            (s, d, b) for s in shapes for d in dtypes for b in backends):
        label = f"{shape} {str(dtype)[6:]} {backend}"
        block_size = 16
        batches = {  # (query lengths, context lengths)
            "decode": ([1] * 8, [ctx, 5, 17, 100, 1, 63, 64, 2 * ctx]),
            "mixed": ([1, 37, 1, 12], [ctx, 0, 9, 30]),
            "prefill": ([70 if small else 700, 20], [0, 0]),
        }
        for kind, (q_lens, c_lens) in batches.items():
            seq_lens = [q + c for q, c in zip(q_lens, c_lens)]
            nb = [math.ceil(n / block_size) for n in seq_lens]
            num_blocks = sum(nb) + 1
            kc = torch.randn(num_blocks, block_size, kvh, hd, generator=gen).to(dtype)
            vc = torch.randn(num_blocks, block_size, kvh, hd, generator=gen).to(dtype)
            perm = torch.randperm(num_blocks, generator=gen)
            width = max(nb)
            table = torch.full((len(q_lens), width), -1, dtype=torch.int32)
            used = 0
            for s, n in enumerate(nb):
                table[s, :n] = perm[used:used + n].to(torch.int32)
                used += n
            qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
            q = torch.randn(int(qsl[-1]), kvh * group, hd, generator=gen).to(dtype)
            sl = torch.tensor(seq_lens, dtype=torch.int32)
            args = [t.to(device) for t in (q, kc, vc, table, qsl, sl)]
            for window in (None, 48):
                expected = reference.paged_attention(*args, hd**-0.5, sliding_window=window)
                got = kernels.paged_attention(*args, hd**-0.5, sliding_window=window, backend=backend)
                ok, err = _close(got, expected, dtype)
                rec(f"paged_attention {kind} window={window} [{label}]", ok, max_abs_err=err)
        n_tok = 33
        x = torch.randn(n_tok, kvh * group * hd, generator=gen).to(dtype).to(device)
        w = torch.randn(kvh * group * hd, generator=gen).to(dtype).to(device)
        r = torch.randn_like(x)
        ok1, e1 = _close(kernels.rms_norm(x, w, 1e-6, backend=backend), reference.rms_norm(x, w, 1e-6), dtype)
        got, got_res = kernels.rms_norm(x, w, 1e-6, r.clone(), backend=backend)
        exp, exp_res = reference.rms_norm(x, w, 1e-6, r.clone())
        ok2, e2 = _close(got, exp, dtype)
        rec(f"rms_norm (+residual) [{label}]", ok1 and ok2 and _close(got_res, exp_res, dtype)[0],
            max_abs_err=max(e1, e2))
        pos = torch.randint(0, 500, (n_tok,), generator=gen).to(device)
        cos_sin = torch.randn(512, hd, generator=gen).to(device)
        qr = torch.randn(n_tok, kvh * group, hd, generator=gen).to(dtype).to(device)
        kr = torch.randn(n_tok, kvh, hd, generator=gen).to(dtype).to(device)
        q1, k1, q2, k2 = qr.clone(), kr.clone(), qr.clone(), kr.clone()
        kernels.rotary_embedding(pos, q1, k1, cos_sin, backend=backend)
        reference.rotary_embedding(pos, q2, k2, cos_sin)
        ok_q, eq = _close(q1, q2, dtype)
        rec(f"rotary_embedding [{label}]", ok_q and _close(k1, k2, dtype)[0], max_abs_err=eq)
        caches = [torch.zeros(20, 16, kvh, hd, dtype=dtype, device=device) for _ in range(4)]
        slots = torch.randperm(320, generator=gen)[:n_tok].to(device)
        slots[3] = -1
        kernels.write_kv_cache(kr, kr * 2, caches[0], caches[1], slots, backend=backend)
        reference.write_kv_cache(kr, kr * 2, caches[2], caches[3], slots)
        rec(f"write_kv_cache [{label}]", bool(torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])))


def _hf_greedy(hf, prompt: list[int], n: int):
    """transformers' greedy tokens and, per position, its top-2 logit gap."""
    import torch

    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt], device=hf.device), do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, output_scores=True, return_dict_in_generate=True,
                          pad_token_id=0, eos_token_id=None)
    gaps = [float(s[0].float().topk(2).values.diff().abs()) for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), gaps


def _compare_greedy(rec, label, engine, hf, prompts, n, near_tie):
    from workbench import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=n,
                                                                             ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    identical, ties, bad = 0, 0, []
    for i, p in enumerate(prompts):
        theirs, gaps = _hf_greedy(hf, p, n)
        ours = list(outs[f"p{i}"])
        first = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if first is None:
            identical += 1
        elif gaps[first] < near_tie:
            ties += 1
        else:
            bad.append({"prompt": i, "position": first, "hf_top2_gap": round(gaps[first], 4)})
    rec(f"greedy parity vs transformers: {label}", not bad, identical=f"{identical}/{len(prompts)}",
        near_ties=ties, mismatches=bad[:5])


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
