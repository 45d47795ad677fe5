# %% [markdown]
# # Exercise 4: chunked prefill, splitting long prompts under the budget
#
# In exercise 1 a waiting prompt ran whole or not at all, so a long prompt could hold up
# everyone behind it, and a prompt longer than the budget could never run. With *chunked
# prefill* (vLLM's default) the scheduler cuts it: it takes what is left of the budget this
# step and continues next step, as a running request part-way through its prompt. You write
# the same `schedule` function as in exercise 1 with that rule, and the grader checks it
# against the engine's scheduler (chunked prefill on) step by step.
#
# ## The rule (vLLM v1's)
#
# 1. **Running requests first**, in order: each gets `min(num_tokens - num_computed_tokens,
#    budget left)`. A running request may still be in its prompt (its last chunk stopped
#    part-way): it continues with its next chunk.
# 2. **Then the waiting queue**, in order, while budget is left and fewer than `max_num_seqs`
#    requests run: each gets `min(its tokens, budget left)` -- a prompt that does not fit is
#    split, not skipped.
#
# A chunk that reaches the last prompt token samples the first output token; the chunks
# before it compute K/V only. The KV cache holds every request, so nobody is preempted.

# %%
import workbench.exercises as ex
from workbench.exercises.batching import BatchWorkload

# A 20-token prompt under an 8-token budget: three chunks, then a decode step.
long_prompt = BatchWorkload(max_num_batched_tokens=8, max_num_seqs=4, requests=(("r0", 0, 20, 2),))
print(long_prompt)

# %% [markdown]
# Worked by hand: step 0 computes prompt tokens 0-7, step 1 tokens 8-15, step 2 the last 4
# (and samples the first token), step 3 decodes the second token. `BatchWorkload` is how the
# grader describes a workload: the budget, the sequence cap, and each request's arrival step,
# prompt length and `max_tokens`; you can pass your own to `check(..., workloads=[...])`.
#
# ## Your code

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
# First on the worked example, then on drawn workloads. The stub schedules nothing, so both
# fail at step 0:

# %%
print(ex.check("chunked_prefill", schedule, workloads=[long_prompt]))

# %%
result = ex.check("chunked_prefill", schedule)
result

# %%
print(result.hint())
print(result.hint())

# %% [markdown]
# `result.show()` opens the `StepPlayer` at the wrong step with both batches side by side:

# %%
# NBVAL_IGNORE_OUTPUT
result.show()

# %% [markdown]
# ## When it passes
#
# `check` prints `PASSED chunked_prefill: ...`. Then compare with exercise 1: which workloads
# give a lower time to first token with chunked prefill, and which a lower inter-token
# latency for the requests already decoding? (Tutorial 04 measures it.)
