"""What a verifying step of n-gram speculation costs beside a plain one, stage by stage, from
the step records' timings (batch 1, the quote workload of ``workbench bench throughput
--compare spec``, 1 thread):

    python tools/spec_step_costs.py [passes, default 2]

The speculating engine's plain (draftless) and verifying steps interleave in one run, so
their ratio holds even while the VM's speed swings; the engine without speculation is shown
beside it. Decode steps only (prefills left out). Speculation at batch 1 pays as far as this
ratio stays near 1: with D draftless and V verifying steps for N tokens, the speed-up is about
N / (D + V x ratio); the last line says what ratio a speed-up of 1.5x needs, and how far the
verifying step is from it.
"""
import statistics
import sys

import torch

from workbench import LLM, SamplingParams
from workbench.benchmarks.datasets import sample_requests
from workbench.benchmarks.throughput import DEFAULT_SPEC_CONFIG
from workbench.engine.history import TIMING_STAGES

torch.set_num_threads(1)
PASSES = int(sys.argv[1]) if len(sys.argv) > 1 else 2
TARGET = 1.5  # issue 36's speed-up at batch 1
requests = sample_requests(8, (64, 128), (128, 128), 4096, dataset="quote")
prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
engines = {"off": LLM(model="tiny-shakespeare", max_num_seqs=1),
           "on": LLM(model="tiny-shakespeare", max_num_seqs=1, speculative_config=DEFAULT_SPEC_CONFIG)}
steps: dict[str, list] = {"off: plain": [], "on: plain": [], "on: verify": []}
for side, llm in engines.items():
    llm.generate(prompts, params, use_tqdm=False)  # warm-up, untimed
    history = llm.llm_engine.history
    for _ in range(PASSES):
        first = len(history)
        llm.generate(prompts, params, use_tqdm=False)
        for record in list(history)[first:]:
            if record.scheduler_output.total_num_scheduled_tokens <= 1 + DEFAULT_SPEC_CONFIG["num_speculative_tokens"]:
                steps[f"{side}: {'verify' if record.spec_decode else 'plain'}"].append(record.timings)
medians = {kind: {stage: statistics.median(t.get(stage, 0.0) for t in ts) * 1e6 for stage in TIMING_STAGES}
           for kind, ts in steps.items()}
print(f"median us per decode step, {PASSES} passes, 1 thread")
print(f"{'step':>11} {'count':>6} " + " ".join(f"{stage:>8}" for stage in TIMING_STAGES) + f" {'total':>8}")
for kind, stages in medians.items():
    print(f"{kind:>11} {len(steps[kind]) // PASSES:>6} " + " ".join(f"{v:>8.0f}" for v in stages.values())
          + f" {sum(stages.values()):>8.0f}")
ratio = sum(medians["on: verify"].values()) / sum(medians["on: plain"].values())
tokens = len(steps["off: plain"]) / PASSES
plain, verify = len(steps["on: plain"]) / PASSES, len(steps["on: verify"]) / PASSES
print(f"a verifying step costs {ratio:.2f}x a plain one of the same run; {tokens:.0f} tokens in "
      f"{plain:.0f} draftless and {verify:.0f} verifying steps: about {tokens / (plain + verify * ratio):.2f}x "
      f"at that ratio ({tokens / (plain + verify):.2f}x if verifying were free)")
plain_us = sum(medians["on: plain"].values())
allowed = (tokens / TARGET - plain) / verify  # tokens / (plain + verify * allowed) == TARGET
print(f"for {TARGET}x a verifying step may cost at most {allowed:.2f}x a plain one: "
      f"+{(allowed - 1) * plain_us:.0f} us over its {plain_us:.0f} us; it costs "
      f"+{(ratio - 1) * plain_us:.0f} us")
