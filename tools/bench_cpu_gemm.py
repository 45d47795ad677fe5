"""N-gram speculation's speed-up, and each engine's own speed, with each CPU linear path
(``kernels/cpu_linear.py``) in one process, so that every path sees the same minutes of a VM
whose speed swings:

    python tools/bench_cpu_gemm.py [R rounds, default 6] [batch (max_num_seqs), default 1] [paths, default torch,onednn,auto]

The workload is ``workbench bench throughput --compare spec``'s (8 quote prompts, inputs
64-128, 128 output tokens, n-gram k=4, 1 thread). For each path (``WORKBENCH_CPU_GEMM``) an
engine without and one with speculation are built under it (the loader chooses the weights'
layout then). In every round each group of ``batch`` prompts runs on every engine back to
back (paths and sides in alternating order), so that a swing of the VM's speed lands on all
of them alike; a round's time for an engine is the sum over the groups. Prints each path's median round
times, the median and range of its rounds' speed-ups, and its engines' speed beside the
first path's; greedy tokens must agree everywhere.
"""
import os
import statistics
import sys
import time

import torch

from workbench import LLM, SamplingParams
from workbench.benchmarks.datasets import sample_requests
from workbench.benchmarks.throughput import DEFAULT_SPEC_CONFIG
from workbench.kernels import cpu_linear

torch.set_num_threads(1)
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 6
BATCH = int(sys.argv[2]) if len(sys.argv) > 2 else 1
PATHS = tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else ("torch", "onednn", "auto")
requests = sample_requests(8, (64, 128), (128, 128), 4096, dataset="quote")
prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
engines, describe = {}, {}
for path in PATHS:
    os.environ["WORKBENCH_CPU_GEMM"] = path
    describe[path] = cpu_linear.describe()
    engines[(path, "off")] = LLM(model="tiny-shakespeare", max_num_seqs=BATCH)
    engines[(path, "on")] = LLM(model="tiny-shakespeare", max_num_seqs=BATCH, speculative_config=DEFAULT_SPEC_CONFIG)
tokens = set()
for (path, _), llm in engines.items():  # warm-up: every engine on its path, untimed
    os.environ["WORKBENCH_CPU_GEMM"] = path
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens.add(tuple(tuple(o.outputs[0].token_ids) for o in outs))
if len(tokens) != 1:
    raise SystemExit("greedy tokens differ between the paths or with speculation: nothing to compare.")
times = {key: [0.0] * ROUNDS for key in engines}
for r in range(ROUNDS):
    for g, i in enumerate(range(0, len(prompts), BATCH)):
        group = (prompts[i:i + BATCH], params[i:i + BATCH])
        for path in (PATHS if (r + g) % 2 == 0 else PATHS[::-1]):
            os.environ["WORKBENCH_CPU_GEMM"] = path
            for side in (("off", "on") if (r + g) % 2 == 0 else ("on", "off")):
                start = time.perf_counter()
                engines[(path, side)].generate(*group, use_tqdm=False)
                times[(path, side)][r] += time.perf_counter() - start
print(f"batch {BATCH}, {ROUNDS} rounds, 1 thread")
print(f"{'path':>7} {'off s':>7} {'on s':>7} {'speed-up':>9} {'rounds':>12} {'off vs ' + PATHS[0]:>13}  linear")
for path in PATHS:
    off, on = times[(path, "off")], times[(path, "on")]
    ratios = [a / b for a, b in zip(off, on)]
    faster = statistics.median(a / b for a, b in zip(times[(PATHS[0], "off")], off))
    print(f"{path:>7} {statistics.median(off):>7.3f} {statistics.median(on):>7.3f} {statistics.median(ratios):>8.2f}x"
          f" {min(ratios):>6.2f}-{max(ratios):.2f}x {faster:>12.2f}x  {describe[path]}")
