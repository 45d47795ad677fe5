# %% [markdown]
# # What-if forks: branch a run at a preemption
#
# A recorded run says what happened; a research question is often what *would* have happened:
# "at step 11 this request was preempted; what if the policy had been different from there on,
# or that request had mattered more, or its rival had been aborted?" Running the workload again
# under another configuration answers a different question (everything before step 11 changes
# too). A *fork* keeps the past and changes only the future. You will:
#
# - find the first preemption of a run and fork the run there, unchanged, to see that the
#   branch repeats it exactly;
# - fork it with another policy, with the victim made important, and with its rival aborted;
# - find where each branch first leaves the original (`first_divergence`) and what every
#   request paid in each branch (time to first token, end-to-end latency);
# - fork a live engine in the middle of sampling and watch both copies continue alike.
#
# The run counts in engine steps (arrivals by step, greedy tokens of exact lengths), so it
# gives the same schedule, and the same branches, on every machine.

# %%
import matplotlib.pyplot as plt

from workbench import (ComparisonView, LLMEngine, SamplingParams, Workload, compare_branches,
                       first_divergence, run_workload, teaching_config)
from workbench.viz.comparison import aligned_timelines

workload = Workload.poisson(num_requests=6, rate=2.0, input_len=(12, 28), output_len=(8, 14), seed=2)
config = teaching_config(num_kv_blocks=16, max_num_seqs=6)
run = run_workload(workload, config)
print(run)  # the plain repr: the HTML one adds wall-clock seconds, which vary from run to run

# %% [markdown]
# Sixteen blocks of four tokens are too few for six requests at once, so the scheduler
# preempts. The first preemption, and who ran in that step:

# %%
step = next(r.step for r in run.history if r.scheduler_output.preempted_request_ids)
record = run.history.record(step)
victim = record.scheduler_output.preempted_request_ids[0]
rival = record.scheduler_output.scheduled[-1].request_id  # the newest request that kept running
print(record)
print(f"victim: {victim}, its newest rival: {rival}")

# %% [markdown]
# ## An unchanged fork repeats the run
#
# `run.fork_at(step, ...)` rebuilds the state at the start of `step` and runs on from there.
# It rebuilds it by *replaying* the workload from the start on a fresh engine: on the step
# clock a replay is exact (the same arrivals, the same batches, the same sampling generators),
# and it is cheap for runs of this size. The replayed steps are checked against the
# recorded ones, so a replay that did not repeat its run would raise an error rather than
# give a wrong branch. With nothing changed, the branch *is* the run:

# %%
same = run.fork_at(step)
print(same.branch)
print("first divergence:", first_divergence(run, same))

# %% [markdown]
# ## Three alternatives from the same step
#
# Each branch keeps steps `0 .. step - 1` as they were and changes what comes next:
#
# - `spf`: shortest prompt first, from the preemption on;
# - `victim first`: the priority policy, with the victim at the highest priority
#   (smaller is served first, as in vLLM);
# - `no rival`: the newest rival aborted just before the step.

# %%
branches = {
    "spf": run.fork_at(step, policy="spf"),
    "victim first": run.fork_at(step, policy="priority", priority={victim: -1}),
    "no rival": run.fork_at(step, abort=[rival]),
}
for name, branch in branches.items():
    print(f"{name:>12}: {branch.branch}")
    print(f"{'':>12}  {first_divergence(run, branch)!r}")

# %% [markdown]
# `first_divergence` names the first step whose batch differs and how: who was scheduled in
# one branch only, whose token counts changed, who was preempted. No branch differs before
# the fork step. Under `spf` the scheduler picks its victim by prompt length instead of
# arrival; with the victim first, another request pays; without the rival, nobody needs
# the victim's blocks at that step.
#
# ## What each alternative would have cost
#
# `compare_branches` puts the run and its branches in one `Comparison`: the summary table,
# and per request what it paid in each branch (steps to the first token and to the end).

# %%
comparison = compare_branches(run, branches)
comparison.table[["num_steps", "num_preemptions", "num_recomputed_tokens", "ttft_steps_p50",
                  "e2e_steps_p50", "e2e_steps_p90"]]

# %%
per_request = comparison.per_request()
per_request

# %%
e2e = per_request["e2e_steps"]
fig, ax = plt.subplots(figsize=(9, 3.2), layout="constrained")
width = 0.8 / len(e2e.columns)
for i, name in enumerate(e2e.columns):
    ax.bar([x + i * width for x in range(len(e2e))], e2e[name], width, label=name)
ax.set_xticks([x + 0.4 - width / 2 for x in range(len(e2e))], e2e.index)
ax.set_ylabel("end-to-end latency (steps)")
ax.set_title(f"Each request's latency in each branch (forked at step {step})")
ax.legend(fontsize="small")
plt.show()

# %% [markdown]
# In `no rival` the rival's bar ends where it was aborted (it never finished its output);
# everyone after it gains. The other bars show who gains and who pays: a branch that spares
# the victim delays someone else, because the pool holds no more tokens than before. The timelines of the four runs share one
# step axis; the dashed line is the fork, and everything left of it is the same in every panel.

# %%
aligned_timelines(comparison.results, fork_step=step)

# %% [markdown]
# In JupyterLab, `ComparisonView(comparison)` shows the same in tabs, with a `StepPlayer` over
# any branch; `%llm replay wl` then `%llm fork STEP --policy spf` does the same from the magics.

# %%
# NBVAL_IGNORE_OUTPUT
ComparisonView(comparison)

# %% [markdown]
# ## Forking a live engine
#
# `engine.fork()` copies a live engine's whole state -- queues, block tables, prefix cache,
# KV tensors, each request's detokenizer and the sampling generators (the per-request ones of
# seeded requests, and the engine's own, which unseeded requests draw from), the LoRA adapters
# and their device slots, the draft model's cache -- and shares only the weights' storage,
# which nothing writes: sleeping, profiling or stepping one engine leaves the other as it was.
# An engine that sleeps, is being profiled, or is being served (`%llm serve`) is not forked:
# the error says what to do instead. Two requests sampled at temperature 1, one seeded and one
# not, are forked after four steps; both engines then finish them:

# %%
engine = LLMEngine(config)
engine.add_request("seeded", "ROMEO:", SamplingParams(temperature=1.0, max_tokens=24, seed=7))
engine.add_request("unseeded", "JULIET:", SamplingParams(temperature=1.0, max_tokens=24))
for _ in range(4):
    engine.step()
twin = engine.fork()


def finish(e):
    texts = {}
    while e.has_unfinished_requests():
        texts.update({o.request_id: o.outputs[0].text for o in e.step() if o.finished})
    return texts


original_texts, twin_texts = finish(engine), finish(twin)
print(original_texts == twin_texts)
for rid, text in original_texts.items():
    print(f"{rid}: {text!r}")

# %% [markdown]
# The twin gave the same tokens, unseeded ones included, and the first engine running to
# the end first did not disturb it: each has its own KV cache and generators.
#
# ## Exercises
#
# 1. Fork at the *second* preemption instead: which branch helps most there, and why?
# 2. Fork with `max_num_seqs=2`: how many steps does the workload take now, and who waits?
# 3. Add a request at the fork (`add=[WorkloadRequest(...)]`) with a long prompt: whom does
#    it delay, and from which step on (`first_divergence`)?
