# %% [markdown]
# # Production traces and capacity under an SLO
#
# Poisson arrivals are a start; services publish what their traffic really looks like. This
# tutorial replays a published trace and asks the question people ask of a configuration:
# *how much load can it take before the p99 breaks the SLO?* You will:
#
# - read production traces (Azure LLM inference, Mooncake with its shared prefix blocks) into
#   workloads, and see how their lengths are fitted to a small model's context;
# - replay one against two configurations, simulated and real;
# - check first whether the simulator's cost model describes *this* machine;
# - find each configuration's capacity under an SLO by bisection on the simulator, and confirm
#   one with real runs at the capacity and at 1.25 times it.

# %%
%matplotlib inline

import pandas as pd

from workbench import EngineConfig, Workload, compare_runs
from workbench.lab.capacity import capacity
from workbench.lab.run import run_real
from workbench.lab.sim import probe_machine, simulate
from workbench.lab.sim.accuracy import schedule_of
from workbench.lab.sweep import sweep
from workbench.lab.traces import SHIPPED

sorted(SHIPPED)

# %% [markdown]
# ## A trace becomes a workload
#
# The project ships small excerpts of public traces in `data/traces/` (its README names each
# source and licence; two of the five are *synthetic* files in the BurstGPT and ShareGPT
# formats, labelled as such, because no real copy could be fetched offline). The Azure 2023
# conversation trace records, per request, its arrival time and its prompt and output lengths
# -- no text. `Workload.from_trace` keeps the arrivals (seconds from the first request) and
# makes prompts of real corpus tokens of those lengths; each request generates exactly its
# recorded output length.
#
# The embedded model's context is 1,024 tokens; Azure's prompts run to 4,000. `fit="scale"`
# (the default) multiplies every length by one factor, so the trace's shape -- which requests
# are long, how prompts compare with outputs -- survives in smaller units; `"clip"` cuts only
# the requests that do not fit, `"drop"` leaves them out. The workload says what was done.

# %%
trace = Workload.from_trace("azure_conv", max_requests=80)
print(trace)
print(f"mean rate {trace.rate:.3f} requests/s")
pd.DataFrame({"arrival_s": [r.arrival_time for r in trace], "prompt_tokens": [len(r.prompt) for r in trace],
              "output_tokens": [r.params.max_tokens for r in trace]}).head(6).round(3)

# %% [markdown]
# `window=(start, end)` takes a slice of the trace in seconds, `rate_scale=2` packs its
# arrivals twice as densely, `rate=` sets the mean rate outright; `wl.at_rate(r)` does the
# same to any workload.
#
# Mooncake's trace adds `hash_ids`: one id per 512-token block of a prompt, equal ids meaning
# equal tokens (a shared system prompt, an earlier turn of the same conversation). They become
# real shared prefixes: a block id is drawn once from the corpus and every request with that
# id carries the same tokens, so the prefix cache finds what the production cache found.

# %%
moon = Workload.from_trace("mooncake_conversation", max_requests=40, fit="clip")
print(moon)
a, b = moon[0].prompt, moon[1].prompt
shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
print(f"requests 0 and 1 share their first {shared} tokens (bos + block 0)")
for caching in (True, False):
    run = simulate(moon.on_clock("steps"), {"num_kv_blocks": 512, "enable_prefix_caching": caching})
    print(f"prefix caching {caching!s:5}: hit rate {run.summary()['prefix_hit_rate']:.2f}, {run.num_steps} steps")

# %% [markdown]
# ## Replaying against two configurations
#
# Two configurations of the same 256-block pool: at most 4 or 16 sequences in a batch. On the
# simulator (the shipped cost model, simulated seconds) the replay is deterministic. At the
# trace's own 2 requests/s the two are alike (nothing waits); packed to 25 requests/s, the
# small batch queues:

# %%
configs = {"4 seqs": {"block_size": 16, "num_kv_blocks": 256, "max_num_seqs": 4},
           "16 seqs": {"block_size": 16, "num_kv_blocks": 256, "max_num_seqs": 16}}
columns = ["num_finished", "ttft_s_p50", "ttft_s_p99", "tpot_s_p99", "e2e_s_p99", "throughput_tok_s"]
pd.concat({f"{rate:.3g}/s": compare_runs(trace.at_rate(rate), configs, simulate=True).table[columns]
           for rate in (trace.rate, 25.0)}).round(4)

# %% [markdown]
# The real engine replays the same trace too. On the step clock (arrivals read as steps:
# `trace.on_clock("steps")`) nothing depends on time, so the real run must make exactly the
# simulated run's decisions, step by step -- checked here on the first 30 requests:

# %%
steps = Workload.from_trace("azure_conv", max_requests=30).on_clock("steps")
real = run_real(steps, configs["16 seqs"])
print(real.num_steps, "steps; identical schedule:", schedule_of(real) == schedule_of(simulate(steps, configs["16 seqs"])))

# %% [markdown]
# ## Does the cost model describe this machine?
#
# Simulated seconds are the cost model's seconds: it was calibrated on the project's 2-core
# VM, on a quiet day. On another machine, or the same one under load, every step takes another
# time and a simulation is off by that factor without saying so. `probe_machine` times a few
# seconds of real steps and compares them with the model's predictions; past 25% it says so
# and names the command that calibrates this machine (`workbench calibrate --output
# my-cost-model.json`; `workbench simulate probe` does the probe from the shell). By default
# it also warns; here its answer is shown instead.

# %%
# NBVAL_IGNORE_OUTPUT
probe = probe_machine(warn=False)
probe

# %% [markdown]
# (The ratio is this machine's, so the output is not checked.) A quick recalibration is the
# shipped model with every time scaled by that ratio (`CostModel.default().scaled(probe.ratio)`);
# `workbench calibrate` is the full one, refitting each coefficient. The capacity search below
# does the quick one itself, at the load its answer is about.

# %% [markdown]
# ## Capacity under an SLO
#
# An SLO bounds p99 latencies: here, time to first token at most 0.1 s and time per output
# token at most 10 ms (in the shipped model's seconds). `capacity` replays the trace with its
# arrivals rescaled: from the trace's own rate it doubles until the SLO breaks, then bisects
# until the bracket is 5% wide. It keeps 10% *headroom* (`headroom=0.1`, the default): every
# metric at most 0.9 times its bound, because a p99 of one run is a noisy figure and a rate
# found exactly at the edge would hold or break on the next run by chance. Each rate it tried
# is a row of its table; `holds` is judged with the headroom.

# %%
slo = {"ttft_s_p99": 0.1, "tpot_s_p99": 0.01}
found = capacity(trace, configs["16 seqs"], slo, progress=False)
print(found)
found.table.drop(columns="error").round(4)

# %%
found.figure()

# %% [markdown]
# The bend is where the queue starts to grow: below it a request waits for nothing but its own
# prefill, above it for every request ahead of it. For both configurations at once, a sweep
# with `capacity=slo` searches each in its own worker (a process pool by default; any
# `concurrent.futures` executor, a Dask cluster's included, works the same) and sends back
# one row per configuration:

# %%
grid = [{"max_num_seqs": 4}, {"max_num_seqs": 16}]
table = sweep(trace, grid, base=EngineConfig(block_size=16, num_kv_blocks=256), capacity=slo, progress=False)
table[["max_num_seqs", "capacity_rate", "capacity_bounded", "rates_tried", "ttft_s_p99_at_capacity",
       "tpot_s_p99_at_capacity"]].round(4)

# %% [markdown]
# ## Confirming with real runs
#
# A simulated capacity is a claim about a real engine; `confirm()` checks it: real runs at the
# rate found (the SLO should hold) and at 1.25 times it (it should break), beside the
# search's own runs. Three things make the claim one a real run can keep:
#
# - **a model of this machine, at this load.** `recalibrate=2` runs the real engine once at
#   the capacity found and rescales the model to that run's steps: one factor for what
#   prefills cost (`prefill_x`), one for the rest (`other_x`), since another machine or
#   thread count moves the two apart. More than 5% off, the search is made again on the
#   rescaled model, at most twice. It is the probe's correction, measured at the load the
#   answer is about;
# - **headroom**, the 10% above;
# - **enough requests.** A finite workload drains in finite time: 20 requests, even all at
#   once, may all start within a second, and then no rate breaks a 1 s TTFT. With 200, a rate
#   25% past the edge builds a queue that shows.
#
# The SLO is now in real seconds: p99 TTFT at most 1 s, p99 TPOT at most 50 ms. The real runs
# take about a minute; their latencies are this machine's and move with its load, so the
# outputs are not checked.

# %%
# NBVAL_IGNORE_OUTPUT
longer = Workload.from_trace("azure_conv", max_requests=200)
real_slo = {"ttft_s_p99": 1.0, "tpot_s_p99": 0.05}
checked = capacity(longer, configs["16 seqs"], real_slo, recalibrate=2, progress=False)
print(checked)
checked.recalibrations.round(4)

# %% [markdown]
# One row per real check: the rate the search had found, the real run's SLO metrics there,
# its median step against the model's (`real_steps_over_model`), the two factors, and
# whether the model was rescaled by them. Then the confirmation:

# %%
# NBVAL_IGNORE_OUTPUT
checked.confirm().round(4)

# %% [markdown]
# Read the `holds` columns: at the capacity both runs should meet the SLO, at 1.25x both
# should miss it. `real_steps_over_model` is the real / predicted step time during the
# confirmation: near 1 the recalibrated model still describes the machine; far from 1 the
# machine's pace moved in the meantime (other load), and the real verdicts carry that.
#
# The same from the shell, one capacity per configuration, with the real confirmation:
#
# ```
# workbench simulate capacity --trace azure_conv --max-requests 200 --num-kv-blocks 256 \
#     --threads 1 --slo ttft_s_p99=1.0 tpot_s_p99=0.05 --grid max_num_seqs=4,16 \
#     --recalibrate 2 --confirm
# ```
#
# (`--search real` searches on the real engine instead, `--cost-model` uses a calibration of
# your own, `--headroom 0` finds the edge itself.) What it printed on the project's VM is in
# `docs/simulation.md`.
#
# ## Exercises
#
# 1. Replay `mooncake_conversation` with `fit="scale"` instead of `"clip"`: what happens to the
#    512-token blocks, and to the prefix hit rate?
# 2. Find the capacity of `azure_code` under the same SLO. Its prompts are longer and its
#    outputs shorter: which bound breaks first, TTFT or TPOT?
# 3. Tighten `tpot_s_p99` until it binds before TTFT does: does 16 sequences still beat 4?
# 4. Search with `run="real"` on the 200-request excerpt and compare the answer with the
#    recalibrated simulator's: how far apart are they, and how much of it is the machine's
#    noise (search twice)?
# 5. Confirm `capacity(..., headroom=0)`: how often does the real run at the edge hold?
