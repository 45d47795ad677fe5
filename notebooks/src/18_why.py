# %% [markdown]
# # Why: every waiting, preempted and missed request explained
#
# A serving engine's users keep asking *why*: why does my request wait, why was it preempted,
# why did the prefix cache miss? vLLM answers with one label at a time
# (`vllm:num_requests_waiting_by_reason{reason="capacity"|"deferred"}`), because its telemetry
# cannot carry per-request detail. A notebook can. Every step the scheduler records, for each
# request it did not fully schedule, a **structured reason** (an enum and its numbers), and it
# explains every preemption and every prefix lookup. You will:
#
# - read the reasons of one step, and one request's story with `run.explain(request_id)`;
# - follow one preemption (the rule, the request it made room for, what it lost) and one
#   prefix miss (the block evicted, when, and for whom);
# - reproduce the admission stall of vLLM issue #53130, see `explain` name it at the step it
#   starts, and fork the engine with the fix to watch the queue drain.
#
# Every run counts in engine steps with greedy tokens of exact lengths, so the schedule is the
# same on every machine.

# %%
from workbench import SamplingParams, StepPlayer, Workload, WorkloadRequest, run_workload, teaching_config

config = teaching_config(num_kv_blocks=10, enable_prefix_caching=True, max_num_batched_tokens=16,
                         max_num_seqs=3)
shared = list(range(11, 19))  # two blocks of 4 tokens that a, b and c share


def request(rid, prompt, max_tokens, step):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return WorkloadRequest(rid, tuple(prompt), params, arrival_step=step)


workload = Workload([request("a", shared + [30, 31, 32], 10, 0), request("b", shared + [40] * 5, 10, 0),
                     request("c", shared + [50, 51], 8, 1), request("d", [60 + i for i in range(14)], 8, 2)])
run = run_workload(workload, config)
print(run)

# %% [markdown]
# Ten blocks of 4 tokens, a budget of 16 tokens a step, at most 3 running requests: four
# requests are more than that. Each `StepRecord` holds `reasons`, request id -> reason, for
# every request the step did not fully schedule. Step 6:

# %%
for rid, why in run.history.record(6).reasons.items():
    print(f"{rid}: {why}")
    print(f"   {why.sentence()}")

# %% [markdown]
# `c` is at the head of the waiting queue and needs 2 blocks when none is free
# (`KVBlocksShort`: needed, free, evictable). `d` could fit a chunk, but nobody overtakes in
# the waiting queue: it is `BehindInOrder` of `c`. The reasons are the scheduler's own tests,
# in vLLM V1's order: a running pass within the token budget, then -- only in a step that
# preempted nobody -- a waiting pass that stops at the first of: budget spent, `max_num_seqs`
# reached, a head that does not fit.
#
# ## One request's story
#
# `run.explain(request_id)` (also `engine.explain` on a live engine and `history.explain`)
# reads the reasons of every recorded step: a sentence per run of equal steps, and a table.

# %%
why = run.explain("c")
print(why)

# %%
why.table.set_index("step")[["state", "reason", "tokens", "numbers"]]

# %% [markdown]
# Over the whole run: how many requests each reason held back, step by step.

# %%
import matplotlib.pyplot as plt

reasons = sorted({w.reason.value for r in run.history for w in r.reasons.values()})
steps = [r.step for r in run.history]
fig, ax = plt.subplots(figsize=(9, 3.2), layout="constrained")
bottom = [0] * len(steps)
for reason in reasons:
    counts = [sum(w.reason.value == reason for w in r.reasons.values()) for r in run.history]
    ax.bar(steps, counts, bottom=bottom, label=reason)
    bottom = [b + c for b, c in zip(bottom, counts)]
ax.set_xlabel("step")
ax.set_ylabel("requests not fully scheduled")
ax.set_title("Why, step by step")
ax.legend(fontsize="small", ncols=2)
plt.show()

# %% [markdown]
# ## One preemption
#
# At step 5, `b`'s next token needed a block and none was free, so the policy picked a victim.
# The record explains the preemption: the rule, the request it made room for, the blocks and
# computed tokens lost, and what resuming will cost (less if the prefix cache keeps its
# blocks until then).

# %%
(preemption,) = run.history.record(5).preemptions
print(preemption)
print(preemption.sentence())

# %% [markdown]
# ## One prefix miss
#
# `c` resumed at step 10. Its prefix lookup reused the two shared blocks, but not its third:
# the block pool remembers which step's allocation evicted that content, and for whom.

# %%
(lookup,) = [p for p in run.history.record(10).prefix_lookups if p.request_id == "c"]
print(lookup)
print(lookup.sentence())

# %% [markdown]
# The `StepPlayer` shows the same: a *why* column for a chunk cut short, and a table of the
# requests left out of the batch with their reason (here at step 6).

# %%
player = StepPlayer(run)
player.show(6)
player

# %% [markdown]
# ## A production stall: vLLM issue #53130
#
# In vLLM's report, once running plus *deferred* requests (waiting for a grammar to compile,
# or for KV from a remote instance) reach `max_num_seqs`, the scheduler admits nothing more --
# with KV blocks free -- until a restart: a deferred request that ends without ever running
# (aborted while its grammar compiles) is never taken off the count, so its seat leaks.
# `DeferredGatePolicy` admits as that gate does. Two constrained requests are aborted while
# compiling at step 0, a third at step 2; `a` runs and finishes; `b` waits.

# %%
from workbench import EngineArgs, LLMEngine
from workbench.core.sched.deferred_gate import DeferredGatePolicy
from workbench.engine.fork import apply_scheduling
from workbench.sampling_params import StructuredOutputsParams

engine = LLMEngine(EngineArgs(device="cpu", block_size=8, num_kv_blocks=32, max_num_seqs=3,
                              policy=DeferredGatePolicy()))
plain = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)


def aborted_while_compiling(rid):
    grammar = StructuredOutputsParams(choice=["yes", "no", rid])  # its own grammar: still compiling
    engine.add_request(rid, {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, structured_outputs=grammar))
    engine.abort_request(rid)


engine.add_request("a", {"prompt_token_ids": list(range(10, 20))}, plain)
aborted_while_compiling("g1")
aborted_while_compiling("g2")
engine.add_request("b", {"prompt_token_ids": list(range(30, 40))}, plain)
for step in range(12):
    if step == 2:
        aborted_while_compiling("g3")
    engine.step()
print(engine.explain("b"))
print(f"free KV blocks: {engine.kv_cache.num_free_blocks} of {engine.kv_cache.num_blocks}")

# %% [markdown]
# From step 6 on nothing runs, nothing is admitted, and every block is free: the explanation
# names the gate (`MaxNumSeqsReached` with 0 running and 3 seats held by deferred requests) at
# the step the stall starts. The fix counts only running requests (the built-in gate). Fork
# the stalled engine, switch its policy, and step both:

# %%
stalled, fixed = engine.fork(), engine.fork()
apply_scheduling(fixed, policy="fcfs")
for _ in range(6):
    stalled.step()
    fixed.step()
print("stalled engine still has work:", stalled.has_unfinished_requests(),
      "| its last batch:", len(stalled.history[-1].scheduler_output.scheduled), "requests")
print("fixed engine drained:", not fixed.has_unfinished_requests())
print(fixed.explain("b"))

# %% [markdown]
# ## Where else the reasons show
#
# - `/metrics`: `vllm:num_requests_waiting_by_reason{reason="capacity"|"deferred"}` (they sum to
#   `vllm:num_requests_waiting`), `vllm:request_deferred_time_seconds{reason="grammar"}` and
#   `workbench:num_preemptions_by_reason`;
# - the request timeline's details name the reasons of each waiting span, and
#   `run.to_perfetto(path)` puts them in the wait slices' args;
# - `workbench bench scheduler --why both --waiting 256` measures what recording them costs.
#
# ## Exercises
#
# 1. Run the first workload with `max_num_batched_tokens=8`. Which reason now dominates `d`'s
#    wait (`run.explain("d").table.reason.value_counts()`), and why does the chunked-prefill
#    limit appear on running requests?
# 2. Give `c` a `cache_salt` in the workload. What does its first prefix lookup say now, and
#    why is its first block not shared with `a` and `b`?
# 3. Change `aborted_while_compiling` so that the requests are *not* aborted. Does the gate
#    still stall? Explain with `engine.explain("b")` which seats are held and when they free.
