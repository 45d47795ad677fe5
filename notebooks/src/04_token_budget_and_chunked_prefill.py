# %% [markdown]
# # The token budget and chunked prefill
#
# Each engine step computes at most `max_num_batched_tokens` tokens (the *token budget*).
# Running requests are served first, one decode token each; what is left of the budget goes
# to prompts waiting to be computed. With *chunked prefill* a long prompt takes the rest of
# the budget this step and continues next step; without it a prompt is computed whole, in
# one step. You will see:
#
# - why the budget trades the waiting requests' time to first token (TTFT) against the
#   running requests' inter-token latency (ITL);
# - a sweep of the budget, with chunked prefill on and off, drawn as one curve;
# - the step where a long prompt is cut into chunks, in the `StepPlayer`.

# %%
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from workbench import StepPlayer, Workload, run_workload

workload = Workload.poisson(num_requests=8, rate=0.5, input_len=(8, 128), output_len=(8, 16), seed=4)
workload

# %% [markdown]
# Eight requests arrive about every two steps, with prompts of 8 to 128 tokens and 8 to 16
# output tokens each (`Workload` cuts real Shakespeare to those exact token lengths; see
# `workload[0].prompt`). Arrivals are counted in engine steps, so every run below sees the
# same requests at the same steps, and the results are the same on every machine.
#
# ## A clock that counts tokens
#
# Counted in steps, every running request gets one token per step whatever the budget, so
# steps alone hide the trade-off: what changes is how *long* a step takes. A step's time is
# a fixed part (reading every weight once, launching kernels) plus a part that grows with
# the tokens it computes. We count time in those units: a step costs
# `STEP_OVERHEAD + tokens computed`, with the fixed part worth 16 tokens (on this CPU it is
# worth about 10; on a GPU serving a 7B model, a hundred or more). From the steps at which each
# request got its tokens we read its TTFT (arrival to first token) and its inter-token
# latencies (between two consecutive tokens).

# %%
STEP_OVERHEAD = 16


def token_clock_latencies(result, step_overhead=STEP_OVERHEAD):
    """Per request of a RunResult: TTFT and inter-token latencies on the token clock."""
    start, end, now = {}, {}, 0
    for record in result.history:
        start[record.step] = now
        now += step_overhead + record.num_scheduled_tokens
        end[record.step] = now
    token_times = {}
    for record in result.history:
        for request_id in record.sampled_token_ids:
            token_times.setdefault(request_id, []).append(end[record.step])
    first_step = result.history[0].step
    rows = []
    for request in result.requests.itertuples():
        times = token_times[request.request_id]
        gaps = np.diff(times)
        rows.append({"request_id": request.request_id, "prompt_tokens": request.num_prompt_tokens,
                     "ttft": times[0] - start[first_step + request.arrival_step],
                     "itl_mean": gaps.mean(), "itl_max": gaps.max()})
    return pd.DataFrame(rows).set_index("request_id")


base = dict(block_size=8, num_kv_blocks=128, max_num_seqs=8)
small = run_workload(workload, dict(base, max_num_batched_tokens=16))
token_clock_latencies(small)

# %% [markdown]
# With a budget of 16 tokens a step never takes more than 32 units, so a running request
# waits at most 32 units for each token; but a 120-token prompt needs eight steps before its
# first token.
#
# ## The sweep
#
# The same workload under budgets of 16, 32 and 64 tokens with chunked prefill, and once
# without it. Without chunking a prompt must fit the budget whole, so the budget has to
# be at least the longest prompt (vLLM even requires the model's whole context length); we
# give it 256.

# %%
runs = {f"chunked, {budget}": dict(base, max_num_batched_tokens=budget)
        for budget in (16, 32, 64)}
runs["not chunked, 256"] = dict(base, max_num_batched_tokens=256, enable_chunked_prefill=False)
results = {"chunked, 16": small}
results.update({name: run_workload(workload, config) for name, config in runs.items() if name not in results})
rows = []
for name, result in results.items():
    latency = token_clock_latencies(result)
    rows.append({"run": name, "steps": result.num_steps,
                 "ttft_p50": latency.ttft.median(), "ttft_p90": latency.ttft.quantile(0.9),
                 "itl_mean": latency.itl_mean.mean(), "itl_worst": latency.itl_max.max()})
sweep = pd.DataFrame(rows).set_index("run")
sweep.round(1)

# %%
fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
chunked = sweep.loc[[name for name in sweep.index if name.startswith("chunked")]]
ax.plot(chunked.itl_worst, chunked.ttft_p90, "o-", label="chunked prefill (p90 TTFT)")
ax.plot(chunked.itl_worst, chunked.ttft_p50, "o--", color="tab:blue", alpha=0.5, label="chunked prefill (median TTFT)")
for name, row in chunked.iterrows():
    ax.annotate(f"budget {name.split(', ')[1]}", (row.itl_worst, row.ttft_p90),
                textcoords="offset points", xytext=(6, 4))
whole = sweep.loc["not chunked, 256"]
ax.plot(whole.itl_worst, whole.ttft_p90, "s", color="tab:red", markersize=9, label="not chunked (p90 TTFT)")
ax.set_xlabel("worst inter-token latency (token-clock units)")
ax.set_ylabel("time to first token (token-clock units)")
ax.set_title("Token budget: first tokens sooner, or smoother streams")
ax.legend()
plt.show()

# %% [markdown]
# Going right along the curve, a bigger budget lets a waiting prompt in sooner (its first
# token comes earlier), but every step that carries a big prefill chunk is a long step, and
# each running request waits through it for its next token. With chunked prefill the budget
# is a dial: a serving system sets it for the ITL its users tolerate. Without chunking there
# is no dial: the longest prompt decides how long a step can get. The red square sits at the
# far end of the curve, and above it: a prompt that does not fit in what is left of this
# step's budget cannot take part of it, so it waits for the next step.
#
# ## The step where a prompt is chunked
#
# With a budget of 32 tokens, long prompts are computed over several steps. We find the
# first step that ran decodes next to a chunk from the middle of a prompt, and open the
# `StepPlayer` there: the batch, the queues after the step and the KV blocks as they were.
# Slide back and forth to see the prompt's later chunks (in JupyterLab; the text below is
# what the player holds).

# %%
budget_32 = results["chunked, 32"]
prompt_len = dict(zip(budget_32.requests.request_id, budget_32.requests.num_prompt_tokens))


def middle_chunk(chunk):
    """A prefill chunk that neither starts nor ends its prompt."""
    return chunk.is_prefill and 0 < chunk.num_computed_tokens and chunk.seq_len < prompt_len[chunk.request_id]


chunked_step = next(
    record.step for record in budget_32.history
    if any(middle_chunk(chunk) for chunk in record.scheduler_output.scheduled)
    and any(not chunk.is_prefill for chunk in record.scheduler_output.scheduled)
)
player = StepPlayer(budget_32)
player.show(chunked_step)
player

# %%
for row in player.batch_rows:
    print(f"{row['request_id']:4} {row['kind']:8} tokens [{row['tokens'][0]:3}, {row['tokens'][1]:3})"
          f"  new {row['num_new_tokens']:3}")
print("queues after the step:", player.queues)

# %% [markdown]
# The running requests got their decode token first; the prompt got what remained of the 32
# tokens, from where its previous chunk stopped. Its first token comes only with its last
# chunk.
#
# ## Exercises
#
# 1. Set `STEP_OVERHEAD = 128` (a GPU-like fixed cost) and redraw the curve: which budget
#    gives the lowest median TTFT now, and why do small budgets suffer?
# 2. Add a run with `max_num_seqs=2`: what happens to TTFT when the budget is large but
#    few requests may run at once?
# 3. Make the workload burstier (`Workload.burst(num_requests=8, num_bursts=2, interval=20,
#    input_len=(8, 128), output_len=(8, 16), seed=4)`) and sweep again: does the best budget
#    change?
