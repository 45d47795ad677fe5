# %% [markdown]
# # Preemption under KV-cache pressure
#
# Every running request needs a new KV block each time its tokens fill the last one. When
# the pool has no free block left, the scheduler must take blocks away from someone: vLLM
# *preempts by recompute*. It frees every block of one running request (under FCFS, the
# one that arrived last), puts it back at the front of the waiting queue, and computes its
# tokens again when there is room. You will:
#
# - shrink the pool under one workload until requests are preempted;
# - scrub back to a preemption and see the pool just before and just after it: which blocks
#   the victim lost, and who needed them;
# - follow the victim until it resumes, and count the tokens it had to compute again;
# - measure what recomputation costs as the pool shrinks.
#
# Every run below counts in engine steps (arrivals by step, greedy tokens of exact lengths),
# so it gives the same schedule on every machine.

# %%
import matplotlib.pyplot as plt
import pandas as pd

from workbench import BlockMap, StepPlayer, Workload, run_workload

workload = Workload.poisson(num_requests=8, rate=2.0, input_len=(12, 32), output_len=(8, 16), seed=2)
config = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=6)
roomy = run_workload(workload, dict(config, num_kv_blocks=64))
print(roomy)  # the plain repr: the HTML one adds wall-clock seconds, which vary from run to run

# %% [markdown]
# Eight requests arrive within three steps. With 64 blocks of 4 tokens (256 token slots)
# every request fits at once and nobody is preempted. Each request needs at most
# `ceil((prompt + output) / 4)` blocks, 12 at most here; all eight together need about 70.
# Now the same workload on 20 blocks:

# %%
tight = run_workload(workload, dict(config, num_kv_blocks=20))
print(tight)
tight.requests.set_index("request_id")[
    ["num_prompt_tokens", "num_output_tokens", "num_preemptions", "num_recomputed_tokens", "e2e_steps"]
]

# %% [markdown]
# The same tokens come out (greedy decoding does not care when a token is computed), but
# several requests were preempted, some more than once, and together they computed a few
# dozen tokens twice. The run took more steps.
#
# ## Back to the first preemption
#
# Every step recorded the scheduler's request events and the KV cache's block events, so
# the run can be replayed to any step. We look for the first preemption of a request that
# had already started generating (one preempted in the middle of its prompt has less to
# lose), and rebuild the pool as it was just before that step and just after it
# (`history.kv_state(step)`).

# %%
prompt_len = dict(zip(tight.requests.request_id, tight.requests.num_prompt_tokens))
step, preempted = next(
    (record.step, event) for record in tight.history for event in record.request_events
    if event.kind == "preempted" and event.num_computed_tokens > prompt_len[event.request_id]
)
victim = preempted.request_id
before, after = tight.history.kv_state(step - 1), tight.history.kv_state(step)
print(preempted)
print(f"{victim}'s block table before step {step}:", before.block_table(victim))
print(f"{victim}'s block table after step {step}: ", after.block_table(victim))
print("free blocks before:", before.num_free_blocks, " after:", after.num_free_blocks)

# %% [markdown]
# The `StepPlayer` opens at that step: the batch that ran, the queues after it, notes on
# what happened (who lost which blocks, and for whom), and the block map as it was, with the
# lost blocks outlined. In JupyterLab, slide back one step to see the pool before.

# %%
player = StepPlayer(tight)
player.show(step)
player

# %%
for note in player.notes:
    print(note)
print("queues after the step:", player.queues)

# %% [markdown]
# The newest running request is the FCFS victim: its computed tokens are gone from the
# cache. Its blocks went back to the free queue, and the full ones kept their prefix hashes,
# so if nobody reuses them before it resumes, the prefix cache gives them back for free.
# The block map before the step, for comparison:

# %%
BlockMap(tight, step=step - 1)

# %% [markdown]
# ## The victim's way back
#
# The request log holds its whole life. When it resumes, the prefix cache is asked first;
# what it still holds is reused, and the rest is computed again (*recomputed tokens*).

# %%
log = tight.history.request_log(victim)
for event in log:
    if event.kind != "scheduled" or event.is_prefill:
        print(event)
hit = sum(e.num_tokens for e in log if e.kind == "prefix_hit" and e.step > step)
print(f"computed before the preemption: {preempted.num_computed_tokens}, found in the prefix cache "
      f"at resume: {hit}, recomputed: {preempted.num_computed_tokens - hit}")

# %% [markdown]
# Only full blocks carry a prefix hash, so the victim's last, partly filled block is lost
# for good, and any full block another request took in the meantime too (the player's note
# names the block the other request got). Those tokens are computed again in one prefill
# chunk when the request resumes, together with the next token.
#
# ## What recomputation costs as the pool shrinks
#
# The same workload on ever smaller pools (each pool still holds the largest request, or the
# engine would refuse it):

# %%
rows = []
for num_blocks in (64, 40, 28, 20, 14):
    result = {64: roomy, 20: tight}.get(num_blocks) or run_workload(workload, dict(config, num_kv_blocks=num_blocks))
    summary = result.summary()
    rows.append({"num_kv_blocks": num_blocks, "steps": result.num_steps,
                 "preemptions": summary["num_preemptions"],
                 "recomputed_tokens": summary["num_recomputed_tokens"],
                 "e2e_steps_p90": summary["e2e_steps_p90"]})
cost = pd.DataFrame(rows).set_index("num_kv_blocks")
cost

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.2), layout="constrained")
left.plot(cost.index, cost.preemptions, "o-", label="preemptions")
left.plot(cost.index, cost.recomputed_tokens, "s-", label="recomputed tokens")
left.set_xlabel("KV cache size (blocks of 4 tokens)")
left.set_title("Work done twice")
left.legend()
right.plot(cost.index, cost.steps, "o-", color="tab:red")
right.set_xlabel("KV cache size (blocks of 4 tokens)")
right.set_ylabel("steps to finish the workload")
right.set_title("Time to finish")
for ax in (left, right):
    ax.invert_xaxis()
plt.show()

# %% [markdown]
# Going right, the pool shrinks. Preemptions grow, but recomputed tokens need not grow
# with them: a request preempted early has little to lose, and the prefix cache hands back
# full blocks nobody took in the meantime. What grows steadily is the time to finish:
# fewer requests fit at once, so the batch is smaller and each request waits longer.
#
# ## Exercises
#
# 1. Run the tight pool with `enable_prefix_caching=False`: how many tokens are recomputed
#    now, and why?
# 2. Give the requests priorities (`Workload.poisson(..., priorities=(0, 1, 2))`) and run
#    with `policy="priority"`: who is preempted now?
# 3. Use blocks of 8 tokens with half as many blocks (the same token slots): do preemptions
#    come sooner or later, and why?
