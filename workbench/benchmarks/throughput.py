"""Offline throughput: the workbench engine beside transformers, on the same requests.

``workbench bench throughput [--num-prompts 96 --input-len-range 32:192 --output-len-range
32:128 --compare hf --batch-invariant --output-json PATH]``. Every request generates exactly its
output length, greedily. Each system runs in its own (spawned) process, one after the other, so
memory and threads do not interfere. Peers (``--compare hf``):

* ``hf-generate``: transformers ``generate`` on left-padded static batches, in request order;
  a batch runs until its longest request is done (``min_new_tokens == max_new_tokens``), but
  only the requested tokens count. Every batch size of ``--hf-batch-sizes`` is timed on the
  whole workload and the best is reported.
* ``hf-generate_batch``: transformers continuous batching (the manager behind
  ``generate_batch``), each request with its own ``max_new_tokens``, its paged cache sized
  to the workload; the manager's setup and warm-up are not timed.

``--structured-outputs KIND`` instead compares the engine free and constrained on the same
requests (time to first token, time per output token, compile and mask times): see
:mod:`workbench.benchmarks.structured`.

``--batch-invariant`` adds the engine with ``batch_invariant=True`` on the same requests (row
``workbench-batch-invariant``; its "ours / it" is the mode's slowdown).

``--async-scheduling`` adds the engine with ``async_scheduling=True`` on the same requests (row
``workbench-async``: step N+1 scheduled while step N executes; its "ours / it" against the
synchronous engine).

``--lora A [B]`` (each ``NAME=PATH``, or a shipped adapter's name: errors, timon) runs, instead
of the single engine row, the base engine beside the engine with ``enable_lora`` three times, all
in one process, round after round (``--lora-rounds``, the best round counts):
``workbench-lora-0`` (no request uses an adapter: the cost of the LoRA layers alone),
``workbench-lora-1`` (every request under A) and ``workbench-lora-2`` (requests alternate A and
B, ``max_loras=2``: both adapters in every batch); "ours / it" is each one's slowdown against
the base engine.

``--speculative-config JSON`` runs the engine with speculative decoding (vLLM's JSON).
``--compare spec`` runs the engine with and without it on the same requests at every batch
size of ``--spec-batch-sizes`` (``max_num_seqs``; default 1,2,4,8,16) and prints them side
by side with the acceptance rate and mean accepted length, and the first batch size where
speculation stops paying (its speed-up falls below 1). Per batch size both engines live in one
(spawned) process and take ``--repeats`` timed passes each (default 3), alternated off/on then
on/off, so a load that comes and goes falls on both alike; each side reports its median pass
and the table the range of the rounds' speed-ups. ``--dataset quote`` gives prompt lookup
something to find (see :mod:`workbench.benchmarks.datasets`).

Output tokens/s = requested output tokens / wall time of the timed run. Every system first runs
the whole workload once untimed (first-touch allocations, caches), so no one's figure carries
one-time costs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

from workbench.benchmarks.datasets import DATASETS, BenchRequest, add_workload_args, sample_requests
from workbench.benchmarks.structured import CONSTRAINTS


@dataclass
class ThroughputResult:
    """One system's figures on the workload (``engine``: workbench | hf-generate | hf-generate_batch)."""

    engine: str
    output_tokens: int
    total_s: float
    num_requests: int
    details: dict = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.total_s

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.total_s

    def to_dict(self) -> dict:
        return {**asdict(self), "output_tokens_per_s": round(self.output_tokens_per_s, 1),
                "requests_per_s": round(self.requests_per_s, 3)}


def _setup(threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)


def _workbench_llm(spec: dict, requests: list[BenchRequest]):
    """The engine ``spec`` describes, warmed up by one untimed run of the whole workload; and
    the workload's prompts and (greedy, exact-length) parameters."""
    from workbench import LLM, SamplingParams

    llm = LLM(model=spec["model"], load_format=spec["load_format"], dtype=spec["dtype"],
              device=spec["device"], **spec["engine_kwargs"])
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: the whole workload, untimed
    return llm, prompts, params


def _timed_pass(llm, prompts, params, requests: list[BenchRequest]):
    """One timed run of the workload: (wall s, process CPU s, its step records, outputs)."""
    llm.engine.history.clear()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    expected = sum(r.output_len for r in requests)
    if tokens != expected:
        raise RuntimeError(f"workbench generated {tokens} tokens, the workload asks for {expected}.")
    return elapsed, cpu, llm.engine.history[:], outs


def _run_workbench(spec: dict, requests: list[BenchRequest]) -> ThroughputResult:
    _setup(spec["threads"])
    llm, prompts, params = _workbench_llm(spec, requests)
    elapsed, cpu, records, _ = _timed_pass(llm, prompts, params, requests)
    return _workbench_result(spec, llm, requests, elapsed, cpu, records)


def _workbench_result(spec: dict, llm, requests: list[BenchRequest], elapsed: float, cpu: float,
                      records: list) -> ThroughputResult:
    import torch

    from workbench.kernels import cpu_linear, ops
    from workbench.metrics.spec_stats import spec_decode_summary

    tokens = sum(r.output_len for r in requests)
    engine = llm.engine
    name = "workbench-batch-invariant" if engine.runner.batch_invariant else "workbench"
    if engine.batch_queue is not None:
        name = "workbench-async"
    details = {
        "attention_backend": engine.attention_backend, "device": str(engine.device),
        "max_num_seqs": engine.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
        "num_kv_blocks": engine.kv_cache.num_blocks, "threads": torch.get_num_threads(),
        "linear": cpu_linear.describe() if engine.device.type == "cpu" else "F.linear",
        "cpu_ops": ops.describe_cpu() if engine.attention_backend == "cpu" else engine.attention_backend,
        "num_steps": len(records), "cpu_s": round(cpu, 3)}
    speculative = spec["engine_kwargs"].get("speculative_config")
    if speculative is not None:
        name = "workbench-spec"
        details["speculative_config"] = speculative
        details.update(spec_decode_summary(records))
    return ThroughputResult(name, tokens, elapsed, len(requests), details=details)


def _run_spec_pair(off_spec: dict, on_spec: dict, requests: list[BenchRequest],
                   repeats: int) -> tuple[ThroughputResult, ThroughputResult, list[float]]:
    """The engine without and with speculation in one process, ``repeats`` timed passes each
    (after one untimed warm-up each), alternated off/on then on/off round after round so that
    neither side always runs first. Each side's result is its median pass (wall and CPU time;
    the faster middle one of an even count), every pass in ``details["runs_s"]``. Returns
    (off, on, each round's speed-up: off wall time / on wall time). Greedy tokens must be the
    same on both sides."""
    _setup(off_spec["threads"])
    sides = {"off": (off_spec, *_workbench_llm(off_spec, requests)),
             "on": (on_spec, *_workbench_llm(on_spec, requests))}
    passes: dict[str, list] = {"off": [], "on": []}
    for round_index in range(repeats):
        for name in (("off", "on") if round_index % 2 == 0 else ("on", "off")):
            _, llm, prompts, params = sides[name]
            passes[name].append(_timed_pass(llm, prompts, params, requests))
    tokens = {name: [list(o.outputs[0].token_ids) for o in runs[-1][3]] for name, runs in passes.items()}
    if tokens["off"] != tokens["on"]:
        raise RuntimeError("greedy tokens differ with speculation: the benchmark measures nothing.")
    results = {}
    for name, runs in passes.items():
        spec, llm = sides[name][:2]
        median = sorted(range(repeats), key=lambda i: runs[i][0])[(repeats - 1) // 2]
        cpu = sorted(r[1] for r in runs)[(repeats - 1) // 2]
        result = _workbench_result(spec, llm, requests, runs[median][0], cpu, runs[median][2])
        result.details.update(repeats=repeats, runs_s=[round(r[0], 4) for r in runs],
                              runs_cpu_s=[round(r[1], 4) for r in runs])
        results[name] = result
    ratios = [off[0] / on[0] for off, on in zip(passes["off"], passes["on"])]
    return results["off"], results["on"], ratios


def _run_lora_rounds(spec: dict, requests: list[BenchRequest]) -> list[ThroughputResult]:
    """The base engine and the LoRA engines (0, 1, 2 adapters in use) side by side in one
    process: ``rounds`` rounds, each timing every engine once on the whole workload in turn
    (after one untimed warm-up run each); each engine's best round is reported, so a load
    that comes and goes on the machine falls on all of them alike."""
    _setup(spec["threads"])
    import torch

    from workbench import LLM, SamplingParams
    from workbench.lora.request import LoRARequest

    loras = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(spec["loras"])]
    rank = max(_adapter_rank(lora.lora_path) for lora in loras)
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    common = dict(model=spec["model"], load_format=spec["load_format"], dtype=spec["dtype"],
                  device=spec["device"], **spec["engine_kwargs"])
    systems = {"workbench": (LLM(**common), [None] * len(requests))}
    for k in range(len(loras) + 1 if len(loras) == 2 else 2):
        used = loras[:k]
        systems[f"workbench-lora-{k}"] = (
            LLM(**common, enable_lora=True, max_loras=max(1, k), max_lora_rank=rank),
            [used[i % k] if k else None for i in range(len(requests))])
    best = {name: float("inf") for name in systems}
    expected = sum(r.output_len for r in requests)
    for round_index in range(spec["rounds"] + 1):
        for name, (llm, per_request) in systems.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_request)
            elapsed = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            if tokens != expected:
                raise RuntimeError(f"{name} generated {tokens} tokens, the workload asks for {expected}.")
            if round_index:  # round 0 is the warm-up
                best[name] = min(best[name], elapsed)
    return [ThroughputResult(name, expected, best[name], len(requests), details={
        "attention_backend": llm.engine.attention_backend, "device": str(llm.engine.device),
        "rounds": spec["rounds"], "threads": torch.get_num_threads(),
        "adapters": sorted({r.lora_name for r in per_request if r is not None})})
        for name, (llm, per_request) in systems.items()]


def _hf_model(spec: dict, model_path: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = {"auto": torch.float32, "float32": torch.float32, "float16": torch.float16,
             "bfloat16": torch.bfloat16}[spec["dtype"]]
    if spec["load_format"] == "dummy":
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.to(spec["device"]).eval()


def _run_hf_generate(spec: dict, requests: list[BenchRequest], model_path: str) -> ThroughputResult:
    _setup(spec["threads"])
    import torch

    model = _hf_model(spec, model_path)
    pad = 0

    def run(batch: list[BenchRequest]) -> None:
        width = max(len(r.prompt_token_ids) for r in batch)
        new = max(r.output_len for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_token_ids)) + list(r.prompt_token_ids)
                            for r in batch], device=model.device)
        mask = (torch.arange(width)[None, :] >= torch.tensor(
            [width - len(r.prompt_token_ids) for r in batch])[:, None]).long().to(model.device)
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=pad, eos_token_id=None)
        if out.shape[1] != width + new:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, asked {new}.")

    timings = {}
    with torch.inference_mode():
        warm = min(max(spec["hf_batch_sizes"]), len(requests))
        for i in range(0, len(requests), warm):  # warm-up: the whole workload, untimed
            run(requests[i:i + warm])
        for bs in spec["hf_batch_sizes"]:
            bs = min(bs, len(requests))
            if bs in timings:
                continue
            t0 = time.perf_counter()
            for i in range(0, len(requests), bs):
                run(requests[i:i + bs])
            timings[bs] = time.perf_counter() - t0
    best = min(timings, key=timings.get)
    tokens = sum(r.output_len for r in requests)
    return ThroughputResult("hf-generate", tokens, timings[best], len(requests), details={
        "batch_size": best, "tokens_per_s_by_batch_size": {
            str(bs): round(tokens / s, 1) for bs, s in timings.items()},
        "attn_implementation": model.config._attn_implementation,
        "threads": torch.get_num_threads()})


def _run_hf_generate_batch(spec: dict, requests: list[BenchRequest], model_path: str) -> ThroughputResult:
    _setup(spec["threads"])
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = _hf_model(spec, model_path)
    longest_out = max(r.output_len for r in requests)
    gen = GenerationConfig(do_sample=False, max_new_tokens=longest_out, eos_token_id=-1, pad_token_id=0)
    # Its KV cache sized to the workload (its default sizes from free memory: seconds of setup
    # on a CPU); the setup and warm-up happen on entering the context, before the clock starts.
    page = ContinuousBatchingConfig().page_size
    blocks = sum(-(-(len(r.prompt_token_ids) + r.output_len) // page) for r in requests)
    cb_config = ContinuousBatchingConfig(num_blocks=blocks + 8)
    hints = WorkloadHints(max(len(r.prompt_token_ids) for r in requests), longest_out, len(requests))
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb_config, workload_hints=hints, warmup=True,
    ) as manager:
        t0 = time.perf_counter()
        for i, r in enumerate(requests):
            manager.add_request(list(r.prompt_token_ids), request_id=f"r{i}",
                                max_new_tokens=r.output_len, eos_token_id=-1)
        tokens, done = 0, 0
        while done < len(requests):
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError("transformers continuous batching returned no result for 60 s.")
            if result.is_finished():
                done += 1
                tokens += len(result.generated_tokens)
        elapsed = time.perf_counter() - t0
    return ThroughputResult("hf-generate_batch", tokens, elapsed, len(requests), details={
        "attn_implementation": model.config._attn_implementation, "num_blocks": blocks + 8,
        "page_size": page, "threads": torch.get_num_threads()})


def _exit_with_parent() -> None:
    """A benchmark child's initializer: end the child when its parent process ends, however
    it ends (a killed benchmark would otherwise leave an engine process holding its memory)."""
    sentinel = multiprocessing.parent_process().sentinel

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _in_own_process(fn, *args):
    """Run ``fn(*args)`` in a fresh spawned interpreter, which ends with this one, and return
    its result."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_exit_with_parent) as pool:
        return pool.submit(fn, *args).result()


def format_table(results: list[ThroughputResult]) -> str:
    """The printed table; the ratio column is the workbench's throughput over each system's."""
    ours = results[0] if results and results[0].engine.startswith("workbench") else None
    lines = [f"{'engine':<26}{'output tok/s':>14}{'requests/s':>12}{'total s':>10}{'ours / it':>11}"]
    for r in results:
        ratio = f"{ours.output_tokens_per_s / r.output_tokens_per_s:>11.2f}" if ours else f"{'':>11}"
        note = f"  (batch {r.details['batch_size']})" if "batch_size" in r.details else ""
        lines.append(f"{r.engine:<26}{r.output_tokens_per_s:>14.1f}{r.requests_per_s:>12.2f}"
                     f"{r.total_s:>10.2f}{ratio}{note}")
    return "\n".join(lines)


def format_spec_table(pairs: list[tuple[int, ThroughputResult, ThroughputResult]],
                      ratios: list[list[float]] | None = None) -> str:
    """Speculation off beside on per batch size (``max_num_seqs``), with the speed-up (on / off
    output tokens/s), the same by the process's CPU seconds (``cpu``: steadier than wall time
    on a machine other work keeps busy), the acceptance rate and the mean accepted length;
    then the first batch size where the wall-time speed-up falls below 1 (or that none did).
    ``ratios``: per batch size, the speed-up of each alternated round (``--repeats``), shown
    as their range (``rounds``) after the speed-up of the medians."""
    lines = [f"{'batch':>5}{'off tok/s':>11}{'on tok/s':>10}{'speed-up':>10}"
             + (f"{'rounds':>13}" if ratios else "")
             + f"{'cpu':>8}{'acceptance':>12}{'mean acc len':>14}{'steps off':>11}{'steps on':>10}"]
    stops = None
    for i, (batch, off, on) in enumerate(pairs):
        gain = on.output_tokens_per_s / off.output_tokens_per_s
        if gain < 1 and stops is None:
            stops = batch
        cpu = off.details["cpu_s"] / on.details["cpu_s"] if on.details.get("cpu_s") else float("nan")
        spread = f"{min(ratios[i]):>7.2f}-{max(ratios[i]):.2f}x" if ratios else ""
        lines.append(f"{batch:>5}{off.output_tokens_per_s:>11.1f}{on.output_tokens_per_s:>10.1f}{gain:>9.2f}x"
                     f"{spread}{cpu:>7.2f}x{on.details['spec_acceptance_rate']:>12.1%}"
                     f"{on.details['spec_mean_acceptance_length']:>14.2f}"
                     f"{off.details['num_steps']:>11}{on.details['num_steps']:>10}")
    lines.append(f"speculation stops paying at batch {stops}" if stops is not None else
                 f"speculation paid at every batch size measured (up to {pairs[-1][0]})")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench bench throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--dataset", default="random", choices=list(DATASETS),
                        help="random token ids, or corpus passages quoted again (default random)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads in every process (default: torch's choice)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="engine option (default: the engine's)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--attention-backend", default=None, help="engine option (default: the engine's)")
    parser.add_argument("--compare", choices=["hf", "spec"], default=None,
                        help="hf: also run transformers generate and generate_batch on the same requests; "
                             "spec: the engine without and with --speculative-config at each --spec-batch-sizes")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="speculative decoding, vLLM's JSON, e.g. '{\"method\": \"ngram\", "
                             "\"num_speculative_tokens\": 4}' (with --compare spec default: that, "
                             "prompt_lookup_min 2, prompt_lookup_max 4)")
    parser.add_argument("--spec-batch-sizes", default="1,2,4,8,16",
                        help="max_num_seqs values for --compare spec (default 1,2,4,8,16)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="also run the engine with batch_invariant=True (its cost: a second row)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="also run the engine with async_scheduling=True (a second row)")
    parser.add_argument("--structured-outputs", choices=list(CONSTRAINTS), default=None,
                        help="compare free and constrained requests (json: one schema; "
                        "json-unique: one per request; regex; choice)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="with --structured-outputs: alternated free/constrained runs; with "
                        "--compare spec: alternated timed passes of each side, in one process "
                        "(default 3)")
    parser.add_argument("--hf-batch-sizes", default="16,32,64,96",
                        help="batch sizes tried for transformers generate (default 16,32,64,96)")
    parser.add_argument("--lora", nargs="+", default=None, metavar="NAME[=PATH]",
                        help="also run the engine serving 0, 1 and 2 of these LoRA adapters (a "
                        "NAME alone: a shipped adapter)")
    parser.add_argument("--lora-rounds", type=int, default=3,
                        help="with --lora: timed rounds over all engines; the best counts (default 3)")
    parser.add_argument("--output-json", default=None, help="write the results here as JSON")
    return parser


def lora_specs(items: list[str]) -> list[tuple[str, str]]:
    """``--lora`` items as (name, path); a name alone is a shipped adapter's."""
    from workbench.model.loader import embedded_lora_path

    specs = []
    for item in items:
        name, sep, path = item.partition("=")
        specs.append((name, path if sep else str(embedded_lora_path(name))))
    return specs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from workbench.model.loader import resolve_model_path
    from workbench.model.model_config import ModelConfig

    model_path = str(resolve_model_path(args.model))
    config = ModelConfig.from_pretrained(model_path)
    from transformers import AutoTokenizer

    special = set(AutoTokenizer.from_pretrained(model_path).all_special_ids)
    try:
        requests = sample_requests(args.num_prompts, args.input_len_range, args.output_len_range,
                                   config.vocab_size, special, args.seed, dataset=args.dataset,
                                   tokenizer=model_path)
        batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
        spec_batch_sizes = _positive_ints(args.spec_batch_sizes, "--spec-batch-sizes")
        speculative = args.speculative_config
        if speculative is None and args.compare == "spec":
            speculative = DEFAULT_SPEC_CONFIG
        if speculative is not None:
            from workbench.config import SpeculativeConfig

            speculative = json.loads(str(SpeculativeConfig.parse(speculative)))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    if longest > config.max_model_len:
        print(f"error: a request needs {longest} tokens, more than the model's max_model_len "
              f"{config.max_model_len}; shorten --input-len-range/--output-len-range.", file=sys.stderr)
        return 2
    engine_kwargs = {k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                                       ("max_num_batched_tokens", args.max_num_batched_tokens),
                                       ("attention_backend", args.attention_backend)) if v is not None}
    spec = {"model": args.model, "load_format": args.load_format, "dtype": args.dtype,
            "device": args.device or _default_device(), "threads": args.threads,
            "engine_kwargs": engine_kwargs, "hf_batch_sizes": batch_sizes}
    lo_in, hi_in = args.input_len_range
    lo_out, hi_out = args.output_len_range
    if args.structured_outputs:
        return _structured(args, spec, requests, config)
    header = (f"model: {config.architecture} ({config.path.name}, {args.load_format} weights, "
              f"dtype {args.dtype}), device: {spec['device']}, {len(requests)} {args.dataset} requests, input "
              f"U[{lo_in},{hi_in}], output U[{lo_out},{hi_out}] exact, greedy, seed {args.seed}")
    if args.compare == "spec":
        if args.repeats < 1:
            print(f"error: --repeats must be >= 1, got {args.repeats}.", file=sys.stderr)
            return 2
        pairs, ratios = [], []
        for batch in spec_batch_sizes:
            kwargs = {**engine_kwargs, "max_num_seqs": batch, "max_history": 1_000_000}
            off, on, rounds = _in_own_process(
                _run_spec_pair, {**spec, "engine_kwargs": kwargs},
                {**spec, "engine_kwargs": {**kwargs, "speculative_config": speculative}},
                requests, args.repeats)
            pairs.append((batch, off, on))
            ratios.append(rounds)
        print(f"{header}, {pairs[0][1].details['threads']} threads, linear: {pairs[0][1].details['linear']}, "
              f"ops: {pairs[0][1].details['cpu_ops']}"
              f"\nspeculative_config: {json.dumps(speculative)}"
              f"\nboth engines in one process per batch size, {args.repeats} timed passes each, "
              "alternated; medians (rounds: min-max of each round's speed-up)")
        print(format_spec_table(pairs, ratios))
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump({"speculative_config": speculative, "repeats": args.repeats, "batches": [
                    {"max_num_seqs": b, "off": off.to_dict(), "on": on.to_dict(),
                     "round_speedups": [round(x, 4) for x in r]}
                    for (b, off, on), r in zip(pairs, ratios)]}, f, indent=1)
        return 0
    if speculative is not None:
        engine_kwargs["speculative_config"] = speculative
        spec["engine_kwargs"] = {**engine_kwargs, "max_history": 1_000_000}
    results = [] if args.lora else [_in_own_process(_run_workbench, spec, requests)]
    if args.batch_invariant:
        invariant = {**spec, "engine_kwargs": {**engine_kwargs, "batch_invariant": True}}
        results.append(_in_own_process(_run_workbench, invariant, requests))
    if args.async_scheduling:
        overlapped = {**spec, "engine_kwargs": {**engine_kwargs, "async_scheduling": True}}
        results.append(_in_own_process(_run_workbench, overlapped, requests))
    if args.lora:
        loras = lora_specs(args.lora)
        if len(loras) > 2:
            print("error: --lora takes one or two adapters.", file=sys.stderr)
            return 2
        results[:0] = _in_own_process(_run_lora_rounds, {**spec, "loras": loras,
                                                         "rounds": args.lora_rounds}, requests)
    if args.compare == "hf":
        results.append(_in_own_process(_run_hf_generate, spec, requests, model_path))
        results.append(_in_own_process(_run_hf_generate_batch, spec, requests, model_path))
    print(f"{header}, {results[0].details['threads']} threads, linear: {results[0].details['linear']}, "
          f"ops: {results[0].details['cpu_ops']}")
    print(format_table(results))
    if speculative is not None:
        d = results[0].details
        print(f"speculative_config: {json.dumps(speculative)}: acceptance {d['spec_acceptance_rate']:.1%}, "
              f"mean accepted length {d['spec_mean_acceptance_length']:.2f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"workload": {"num_prompts": len(requests), "input_len_range": [lo_in, hi_in],
                                    "output_len_range": [lo_out, hi_out], "seed": args.seed,
                                    "model": model_path, "load_format": args.load_format,
                                    "dtype": args.dtype, "device": spec["device"]},
                       "results": [r.to_dict() for r in results]}, f, indent=1)
    return 0


def _adapter_rank(path: str) -> int:
    """The rank ``r`` of a PEFT adapter directory (the engine's max_lora_rank for it)."""
    from pathlib import Path

    return int(json.loads((Path(path) / "adapter_config.json").read_text())["r"])


def _structured(args, spec: dict, requests: list[BenchRequest], config) -> int:
    """``--structured-outputs``: the free and the constrained run, each in its own process."""
    from workbench.benchmarks import structured

    results = _in_own_process(structured.run_compare, spec, requests, args.structured_outputs,
                              args.repeats)
    print(f"model: {config.architecture} ({config.path.name}), device: {spec['device']}, "
          f"{len(requests)} requests at once, input U{list(args.input_len_range)}, output up to "
          f"U{list(args.output_len_range)}, greedy, seed {args.seed}, {results[0]['threads']} "
          f"threads; constraint: {args.structured_outputs}; median of {args.repeats} "
          "alternated runs")
    print(structured.format_table(results))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"constraint": args.structured_outputs, "results": results}, f, indent=1)
    return 0


#: ``--compare spec`` without ``--speculative-config``: n-gram prompt lookup, k = 4.
DEFAULT_SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 2}


def _positive_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}.") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} values must be >= 1, got {text!r}.")
    return values


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
