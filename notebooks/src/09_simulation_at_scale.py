# %% [markdown]
# # Simulation at scale
#
# On this CPU the engine computes a few thousand tokens per second: enough to watch a
# schedule, far too few to ask what a day of traffic would do. The simulator answers those
# questions with the engine's own `Scheduler` and `KVCacheManager`, unchanged, and a runner
# that *predicts* how long each step takes instead of computing its tokens. Everything a real
# run leaves behind (step records, block events, request metrics) a simulated run leaves too,
# on a simulated clock. You will:
#
# - read the cost model of a step, and calibrate one on this machine from designed batches;
# - check a simulation against a real run of the same workload: the schedule, step by step,
#   and the latencies in seconds;
# - sweep a 100,000-request trace over scheduling configurations and draw the Pareto front of
#   throughput against p99 time to first token;
# - switch on the batch-invariant mode and see a request's logprobs stop depending on its batch.

# %%
import functools

import matplotlib.pyplot as plt
import numpy as np
import torch

from workbench import EngineConfig, LLMEngine, SamplingParams, Workload, replay_workload, run_workload
from workbench.lab.sim import CalibrationGrid, CostModel, calibrate, simulate
from workbench.lab.sim.accuracy import latency_errors, schedule_of
from workbench.lab.sweep import sweep
from workbench.viz.pareto import pareto_figure, pareto_front

shipped = CostModel.default()
shipped

# %% [markdown]
# ## A step's cost
#
# A step's duration is predicted from its batch alone, as a sum of eight parts: a fixed cost
# per step (Python, the scheduler, launching the layers), a fixed cost for a step that runs
# any prefill (the prefill path's plan, masks and kernels), a cost per prefill token (the
# matmuls), a cost per prefill chunk (each is its own attention call in every layer), a cost
# per decoding sequence and one per square root of their number (one row is a matrix-vector
# product, many rows a matrix product: the cost per sequence falls as the batch grows), a cost
# per KV token a decode attends to, and a cost per query-key pair of a prefill chunk (causal
# attention grows with the square of a prompt). Two costs come from the driver, between steps:
# tokenizing a text prompt that arrives (per request and per token), and waking up when a
# request finds the engine idle. Above is the calibration that ships with the project,
# measured on the 2-core machine the project is developed on. Its `fit` line says how well
# these numbers describe real steps.
#
# Your machine is another one, so calibrate on it. `calibrate` runs a designed set of batches
# on the real engine (decodes of 1 to 128 sequences at short and long contexts, prefills of 8
# to 768 tokens with and without cached context, mixed batches) and two short stretches of
# Poisson traffic with text prompts, times every step, and fits the coefficients by least
# squares. It takes well under a minute here.

# %%
# NBVAL_IGNORE_OUTPUT
config = EngineConfig()
mine = calibrate(config, CalibrationGrid(), progress=False)
mine

# %% [markdown]
# (The figures differ from run to run and machine to machine, so this cell's output is not
# checked.) `mine.save("my-cpu.json")` keeps it; `CostModel.load` reads it back; the CLI does
# the same: `workbench calibrate --output my-cpu.json`.
#
# ## Is the simulation right?
#
# Two checks, on a workload the calibration never saw: 40 requests arriving as a Poisson
# process, prompts of 40 to 400 tokens in four groups that share a 32-token prefix, 4 to 96
# output tokens each.
#
# First the schedule. With arrivals counted in steps (a workload on `clock="steps"`, the
# default: its rate is per step), nothing depends on time, so the simulated run must make
# exactly the decisions of the real one: the same requests in the same steps with the same
# number of tokens, the same preemptions, the same prefix hits.

# %%
shape = dict(input_len=(40, 400), output_len=(4, 96), num_prefix_groups=4, prefix_len=32, seed=21)
workload = Workload.poisson(40, rate=6.0, clock="steps", **shape)  # 6 arrivals per step
real_steps = run_workload(workload, config)
simulated_steps = simulate(workload, config, mine)
print("steps:", real_steps.num_steps, "real,", simulated_steps.num_steps, "simulated")
print("identical schedules:", schedule_of(real_steps) == schedule_of(simulated_steps))

# %% [markdown]
# Then time. With arrivals in seconds (a workload on `clock="wall"`: the same draws, 6 per
# second), a request arrives at the first step boundary after its arrival time, so how long
# steps take decides which steps it joins. We run
# the real engine (after one untimed run of the same workload: a process's first passes over
# new shapes pay one-time costs) and the simulation, and compare every request's time to first
# token (TTFT) and end-to-end latency.

# %%
# NBVAL_IGNORE_OUTPUT
timed = Workload.poisson(40, rate=6.0, clock="wall", **shape)  # 6 arrivals per second
engine = LLMEngine(config)
replay_workload(engine, timed)
engine.reset_prefix_cache()
real = replay_workload(engine, timed)
simulated = simulate(timed, config, mine)
for metric in ("ttft_s", "e2e_s"):
    errors = latency_errors(real, simulated, metric)
    print(f"{metric}: median relative error {np.median(errors):.1%}, p90 {np.percentile(errors, 90):.1%}")

# %%
# NBVAL_IGNORE_OUTPUT
fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
for ax, metric in zip(axes, ("ttft_s", "e2e_s")):
    a = real.requests.set_index("request_id")[metric]
    b = simulated.requests.set_index("request_id")[metric].reindex(a.index)
    ax.scatter(a * 1e3, b * 1e3, s=12)
    top = max(a.max(), b.max()) * 1e3
    ax.plot([0, top], [0, top], color="grey", lw=0.8)
    ax.set(xlabel=f"real {metric[:-2]} (ms)", ylabel=f"simulated {metric[:-2]} (ms)", title=metric[:-2])
fig.tight_layout()

# %% [markdown]
# Points on the diagonal are requests the simulation timed right. Most land within a few
# percent on this machine; the others carry the noise of single steps (the OS, a neighbour on
# the host, a cold cache after an idle gap), which no step model predicts. A real run is not
# exact either: two real runs of the same workload differ by 3-12% per request here, the floor
# any simulation is measured against. `workbench simulate accuracy` runs this check on two
# arrival rates, against the median of three real runs, and prints the errors beside that
# floor and beside `step_real_over_model`, how fast the real steps ran against the cost model
# (1.10: the machine ran 10% slower than when it was calibrated, and the simulation will be
# about that far off); `--calibrate` calibrates first, on the machine as it is now.
#
# ## A 100,000-request trace
#
# Now a trace no real run on this machine could serve in a session: 100,000 requests at 450
# per second (about 7,200 output tokens per second: near what this CPU can serve), prompts of 16 to 64 tokens given as token ids,
# answers of 1 to 31 tokens. One simulated run of it takes about half a minute here; a sweep
# runs one simulation per configuration, in parallel processes. We use the shipped
# calibration, so that these figures are the same on every machine, and ask how the number of
# sequences per step and the token budget trade throughput against the time to first token.

# %%
trace = Workload.poisson(100_000, rate=450.0, input_len=(16, 64), output_len=(1, 31), seed=3, text=False,
                         clock="wall")
trace

# %%
grid = {"max_num_seqs": [32, 64, 256], "max_num_batched_tokens": [256, 2048]}
frame = sweep(trace, grid, run=functools.partial(simulate, cost_model=shipped), progress=False)
frame[["max_num_seqs", "max_num_batched_tokens", "throughput_tok_s", "ttft_s_p50", "ttft_s_p99",
       "e2e_s_p99", "num_preemptions"]].round(3)

# %% [markdown]
# Each row is a whole simulated run of the trace. `sweep` takes any `concurrent.futures`
# executor (`executor=`): a process pool by default, a Dask or Ray cluster's executor when a
# grid outgrows one machine. The configurations no other one beats on both throughput and
# p99 TTFT form the Pareto front:

# %%
pareto_front(frame)[["max_num_seqs", "max_num_batched_tokens", "throughput_tok_s", "ttft_s_p99"]].round(3)

# %%
pareto_figure(frame)

# %% [markdown]
# Only the configurations that can serve the trace's 7,200 tokens per second keep up with it:
# their queues stay short and the first token comes within milliseconds. The others fall
# behind, their queue grows for the whole trace and p99 TTFT reaches seconds. On this CPU a
# step's fixed cost is large next to what one more sequence or prompt token adds, so fuller
# steps win on both axes and the front is short; the exercises look for real trade-offs.
#
# ## Batch invariance
#
# A request's logits depend, in the last bits, on what else is in its batch: a matrix product
# sums in an order that depends on how many rows it multiplies, attention on how keys were
# split. Tokens rarely change, logprobs do. With `EngineConfig(batch_invariant=True)` every
# reduction runs in a fixed order per row, so a request's logprobs are bitwise the same alone
# or in any batch, chunked or not. We compute one prompt's logprobs alone, then beside seven
# other prompts, in both modes.

# %%
prompts = [f"ROMEO: {w}" for w in ("But soft", "What light", "It is the east", "Arise, fair sun",
                                   "She speaks", "O, speak again", "Thou art", "Deny thy father")]
params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, prompt_logprobs=0)


def logprobs(engine, batch):
    """The first prompt's prompt and sampled-token logprobs, run with `batch` as companions."""
    for i, prompt in enumerate(batch):
        engine.add_request(f"r{i}", prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    out = outputs["r0"]
    prompt = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    sampled = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
    return torch.tensor(prompt + sampled, dtype=torch.float64)


# %%
# NBVAL_IGNORE_OUTPUT
engine = LLMEngine(block_size=8, num_kv_blocks=256)
difference = (logprobs(engine, prompts[:1]) - logprobs(engine, prompts)).abs().max().item()
print(f"largest difference, alone vs in a batch of 8: {difference:.2e}")

# %% [markdown]
# (How large, if at all, depends on your CPU's math library: this output is not checked.)
# Now the same in the batch-invariant mode:

# %%
engine = LLMEngine(block_size=8, num_kv_blocks=256, batch_invariant=True)
alone, together = logprobs(engine, prompts[:1]), logprobs(engine, prompts)
print(f"{len(alone)} logprobs, bitwise equal alone and in a batch of 8: {torch.equal(alone, together)}")

# %% [markdown]
# Equal, bit for bit, whatever the companions, their order, or how the prompt was chunked.
# The price is speed: `workbench
# bench throughput --batch-invariant` runs both modes and prints their ratio.
#
# ## Exercises
#
# 1. Calibrate with `CalibrationGrid.tiny()`: how far do its coefficients and its `fit` line
#    move from `mine`, and how much worse is the latency check?
# 2. Add `"policy": ["fcfs", "spf"]` to the grid: where on the Pareto front does shortest
#    prompt first land, and which requests pay for it (compare `ttft_s_p50` and `ttft_s_p99`)?
# 3. Halve the KV pool (`"num_kv_blocks"` in the grid): at which configuration do preemptions
#    start, and what do they cost in throughput?
# 4. Fit a cost model to the real run above with `CostModel.fit(real)` and simulate with it:
#    is it closer than the calibration, and why can it not be used for a new workload's check?
