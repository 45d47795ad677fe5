# %% [markdown]
# # Changing the scheduler's mind: policies you write in a notebook
#
# The scheduler asks a *policy* object two questions: in which order should waiting requests be
# admitted, and which running request should be preempted when the KV cache is full. This
# tutorial writes a policy in a few lines and compares it with the built-in first-come,
# first-served (FCFS) and priority policies on the same bursty workload. You will see:
#
# - what a policy is (`sort_key` and `pick_victim`) and how to write one;
# - `compare_runs`: one workload, several engine configurations, a table of latencies;
# - the latency distributions (CDFs) and the request timelines of the runs side by side;
# - that a policy changes *when* tokens are computed, never *which* tokens.

# %%
%matplotlib inline

from workbench import ComparisonView, Workload, compare_runs, teaching_config
from workbench.core.sched.policies import SchedulingPolicy
from workbench.viz.comparison import aligned_timelines

workload = Workload.burst(num_requests=10, num_bursts=2, interval=10, input_len=(8, 64),
                          output_len=(4, 20), priorities=(0, 1), seed=5)
workload

# %% [markdown]
# Two bursts of five requests, ten steps apart, with prompts of 8 to 64 tokens, 4 to 20
# output tokens and a priority of 0 (urgent) or 1. Arrivals are counted in engine steps, so
# every run sees the same requests at the same steps and the results below are the same on
# every machine. The engine is the *teaching engine*: 24 blocks of 4 tokens, 32 tokens and
# 4 requests per step, small enough for the queue to matter.

# %%
config = teaching_config()
print({name: getattr(config, name) for name in
       ("block_size", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs", "policy")})
for request in workload:
    print(f"{request.request_id}: arrives at step {request.arrival_step:2}, priority {request.priority}, "
          f"{request.params.max_tokens:2} output tokens")

# %% [markdown]
# ## A policy in a few lines
#
# `sort_key(request)` orders the waiting queue (smaller first; the base class returns
# `None`, which keeps arrival order: FCFS). `pick_victim(running)` chooses whom to preempt;
# by default the running request with the largest key. Here: *least work first*, the
# request with the fewest tokens left to compute (prompt plus the tokens it will generate)
# goes first. The engine knows a request's output length only through `max_tokens`, which
# is exact in this workload (every request ignores EOS); in real traffic it is an upper
# bound, and a policy like this one needs an estimate.
#
# `compare_runs` runs one workload under several configurations, each on a fresh engine. (As
# in vLLM, an engine refuses a request priority under a built-in policy that ignores it, so
# the FCFS run gets the same requests with their priorities cleared.)

# %%
class LeastWorkFirst(SchedulingPolicy):
    name = "least-work"

    def sort_key(self, request):
        work = request.num_prompt_tokens + request.sampling_params.max_tokens - request.num_computed_tokens
        return (work, request.arrival_time)


comparison = compare_runs(
    workload,
    {"fcfs": {"policy": "fcfs"}, "priority": {"policy": "priority"}, "least-work": {"policy": LeastWorkFirst()}},
    base=teaching_config(),
)
columns = ["num_steps", "ttft_steps_p50", "ttft_steps_p90", "e2e_steps_p50", "e2e_steps_p90",
           "num_preemptions", "num_recomputed_tokens"]
comparison.table[columns]

# %% [markdown]
# Latencies are counted in steps (`*_steps`): the number of engine steps from a request's
# arrival to its first token (TTFT) or to its last (end to end). The policies do not even
# take the same number of steps to finish the same work: the order of admissions decides
# how well the batches fill and how often the pool overflows. The CDFs show the whole
# distribution, one line per policy (`Comparison.cdf_figure` draws them):

# %%
comparison.cdf_figure("ttft_steps")

# %%
comparison.cdf_figure("e2e_steps")

# %% [markdown]
# Under priority the urgent requests wait less, and the others pay for it. Least work first
# lets the small requests through first, which lowers the median; the long ones wait
# longest, the price of any shortest-job-first rule. Per priority class:

# %%
priority_of = {request.request_id: request.priority for request in workload}
for name, result in comparison.results.items():
    ttft = result.requests.set_index("request_id")["ttft_steps"]
    by_priority = ttft.groupby(ttft.index.map(priority_of)).mean()
    print(f"{name:10} mean TTFT in steps: " + ", ".join(f"priority {p}: {v:.1f}" for p, v in by_priority.items()))

# %% [markdown]
# ## The timelines side by side
#
# One panel per run, one row per request (the same row and colour in every panel), from
# arrival to finish: waiting, prefill chunks, decoding and any time spent preempted. Look
# for the price of least work first: a request with much work left is the last to be
# admitted and the first to be preempted, again and again (starvation).

# %%
aligned_timelines(comparison.results)

# %% [markdown]
# `ComparisonView` puts the table and CDFs, the timelines and a `StepPlayer` over any of the
# runs in one widget (in JupyterLab: tabs, a metric picker and a run picker):

# %%
# NBVAL_IGNORE_OUTPUT
# (not compared by the tests: the widget's static HTML also shows wall-clock seconds)
view = ComparisonView(comparison)
view.show_metric("e2e_steps")
view

# %% [markdown]
# The generated text does not depend on the policy: scheduling changes *when* tokens are
# computed, never *which* tokens (greedy decoding, the same model).

# %%
texts = {name: {rid: out.outputs[0].text for rid, out in result.outputs.items()}
         for name, result in comparison.results.items()}
print("same texts under every policy:", texts["fcfs"] == texts["priority"] == texts["least-work"])
print(repr(texts["fcfs"][workload[0].request_id]))

# %% [markdown]
# ## Exercises
#
# 1. Write `LongestPromptFirst` (its `sort_key` returns `(-request.num_prompt_tokens,
#    request.arrival_time)`), add it to `compare_runs` and compare its p90 TTFT with FCFS.
# 2. Override `pick_victim` in `LeastWorkFirst` to preempt the request with the *least*
#    work done (`min(running, key=lambda r: r.num_computed_tokens)`) and compare the
#    recomputed tokens.
# 3. Give the engine more room (`base=teaching_config(num_kv_blocks=64, max_num_seqs=8)`):
#    do the policies still differ, and why?
