"""N-gram speculation's speed-up with each CPU linear path (``kernels/cpu_linear.py``), in one
process, so that both paths see the same minutes of a VM whose speed swings:

    python tools/bench_cpu_gemm.py [R rounds, default 6] [batch (max_num_seqs), default 1]

The workload is ``workbench bench throughput --compare spec``'s (8 quote prompts, inputs
64-128, 128 output tokens, n-gram k=4, 1 thread). The engines without and with speculation are
built once; in every round each path (``WORKBENCH_CPU_GEMM=torch``, then ``auto``, the order
alternating) runs both engines (order alternating). Prints each path's median pass times and
the median and range of its rounds' speed-ups; greedy tokens must agree across all four.
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
PATHS = ("torch", "auto")
requests = sample_requests(8, (64, 128), (128, 128), 4096, dataset="quote")
prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
engines = {"off": LLM(model="tiny-shakespeare", max_num_seqs=BATCH),
           "on": LLM(model="tiny-shakespeare", max_num_seqs=BATCH, speculative_config=DEFAULT_SPEC_CONFIG)}
tokens = set()
for path in PATHS:  # warm-up: every engine on every path, untimed
    os.environ["WORKBENCH_CPU_GEMM"] = path
    for llm in engines.values():
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens.add(tuple(tuple(o.outputs[0].token_ids) for o in outs))
if len(tokens) != 1:
    raise SystemExit("greedy tokens differ between the paths or with speculation: nothing to compare.")
times = {(path, side): [] for path in PATHS for side in engines}
for r in range(ROUNDS):
    for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
        os.environ["WORKBENCH_CPU_GEMM"] = path
        for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
            start = time.perf_counter()
            engines[side].generate(prompts, params, use_tqdm=False)
            times[(path, side)].append(time.perf_counter() - start)
os.environ["WORKBENCH_CPU_GEMM"] = "auto"
print(f"batch {BATCH}, {ROUNDS} rounds, 1 thread; auto here: {cpu_linear.describe()}")
print(f"{'path':>6} {'off s':>7} {'on s':>7} {'speed-up':>9} {'rounds':>12}")
for path in PATHS:
    ratios = [a / b for a, b in zip(times[(path, "off")], times[(path, "on")])]
    print(f"{path:>6} {statistics.median(times[(path, 'off')]):>7.3f} {statistics.median(times[(path, 'on')]):>7.3f}"
          f" {statistics.median(ratios):>8.2f}x {min(ratios):>6.2f}-{max(ratios):.2f}x")
