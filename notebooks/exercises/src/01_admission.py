# %% [markdown]
# # Exercise 1: the admission loop of a continuous-batching scheduler
#
# Every engine step, the scheduler decides which requests compute how many tokens. You write
# that decision for an engine with chunked prefill **off**, and the grader checks it against
# the engine's own scheduler step by step, on workloads it draws (from a fixed seed, so the
# feedback is the same every time you run it). When a step differs, it tells you which one
# and what differed, and opens the `StepPlayer` there.
#
# ## The rule (vLLM v1's)
#
# Two limits hold every step: at most `max_num_batched_tokens` tokens are computed (the
# *token budget*), and at most `max_num_seqs` requests are running.
#
# 1. **Running requests first**, in their order: each gets the tokens it has left to compute,
#    `num_tokens - num_computed_tokens` (one, for a request that is decoding), as far as the
#    budget goes.
# 2. **Then the waiting queue**, in order, while budget is left and fewer than `max_num_seqs`
#    requests run (the running ones count). With chunked prefill off, a waiting request is
#    admitted only if *all* its tokens fit what is left of the budget; the first one that does
#    not fit stops the pass (nobody behind it overtakes).
#
# Here the KV cache is large enough for every request, so nobody is preempted.

# %%
import workbench.exercises as ex
from workbench.exercises.batching import RequestView

print(ex.names())
RequestView("r0", num_prompt_tokens=5, num_tokens=7, num_computed_tokens=6)

# %% [markdown]
# Your function receives the queues as `RequestView`s: `r0` above has a 5-token prompt and 2
# generated tokens, 6 of whose K/V are computed: it needs one more token (a decode step).
# A waiting request has `num_computed_tokens == 0`.
#
# ## Your code
#
# Fill in `schedule`. Return the batch as a list of `(request_id, num_new_tokens)`; leave out
# the requests that do not run this step.

# %%
def schedule(running, waiting, max_num_batched_tokens, max_num_seqs):
    """One step's batch: a list of (request_id, num_new_tokens).

    running, waiting: lists of RequestView (request_id, num_prompt_tokens, num_tokens,
    num_computed_tokens), running in their order, waiting in serving order.
    """
    batch = []
    # your code here
    return batch


# %% [markdown]
# ## Check it
#
# `check` runs your function beside the engine on up to 60 drawn workloads and reports the
# first step that differs (or that everything matched). As given, the stub schedules
# nothing, so the very first step is wrong:

# %%
result = ex.check("admission", schedule)
result

# %% [markdown]
# `result.passed`, `result.first_wrong_step` and `result.message` say the same in code.
# `result.hint()` gives one hint per call, each more precise than the last:

# %%
print(result.passed, result.first_wrong_step)
print(result.hint())

# %% [markdown]
# `result.show()` opens the `StepPlayer` at the wrong step, with the engine's batch and
# yours side by side above it (the player shows what the engine did, its queues and its KV
# blocks):

# %%
# NBVAL_IGNORE_OUTPUT
view = result.show()
view

# %%
table, player = view.children
print("player at step", player.step, "| queues after it:", player.queues)

# %% [markdown]
# ## When it passes
#
# A correct `schedule` prints `PASSED admission: your batches equal the engine's at every step
# of 60 workloads.` The engine's own piece, in the same shape, is `ex.reference("admission")`
# -- read it only after you have passed. Then go on to exercise 4 (chunked prefill), which
# changes one rule of this loop.
