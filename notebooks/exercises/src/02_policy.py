# %% [markdown]
# # Exercise 2: a scheduling policy, and the starvation it causes
#
# Which waiting request does the scheduler serve first? First come, first served (FCFS) is
# fair; *shortest prompt first* (SPF) gets more requests to their first token sooner, because
# short prompts stop waiting behind long ones. You write SPF as a policy object the engine
# runs; the grader runs your policy in a real engine beside one running the engine's own SPF,
# on workloads tight enough to preempt, and compares every step. Then you measure what SPF
# costs the long prompts, and design a policy that keeps its gain without starving them.
#
# ## The policy interface
#
# A policy subclasses `SchedulingPolicy` and overrides `sort_key(request)`: the waiting queue
# serves the smallest key first (the engine keeps a heap on `(key, insertion number)`; the key
# is taken when a request enters the queue -- on arrival, and again when it is preempted and
# re-enters). The inherited `pick_victim(running)` preempts the running request with the
# *largest* key, the one the policy would serve last, when the KV cache runs out.
#
# SPF's rule (the engine's `ShortestPromptFirstPolicy`): fewest prompt tokens first; among
# equal prompts, the earlier arrival.

# %%
import pandas as pd

import workbench.exercises as ex
from workbench.core.sched.policies import SchedulingPolicy
from workbench.exercises.policy import PolicyWorkload, starvation

pd.set_option("display.width", 120)

# %% [markdown]
# A request exposes `num_prompt_tokens`, `num_tokens` (prompt and generated so far),
# `arrival_time` and `priority`. A small workload where the two orders differ: with one
# sequence at a time, FCFS would run the 5-token prompt `r1` before the 1-token `r2`.

# %%
small = PolicyWorkload(num_blocks=16, max_num_batched_tokens=4, max_num_seqs=1, requests=(
    ("r0", 0, 2, 2), ("r1", 1, 5, 1), ("r2", 1, 1, 1),
))
print(small)

# %% [markdown]
# ## Your code

# %%
class ShortestPromptFirst(SchedulingPolicy):
    """Serve the waiting request with the fewest prompt tokens first."""

    name = "my_spf"

    def sort_key(self, request):
        """The waiting-queue key: the smallest key is served first."""
        # your code here
        return 0


# %% [markdown]
# ## Check it
#
# The stub's constant key leaves the queue in arrival order (FCFS):

# %%
print(ex.check("policy", ShortestPromptFirst, workloads=[small]))

# %%
result = ex.check("policy", ShortestPromptFirst)
result

# %%
print(result.hint())
print(result.hint())

# %% [markdown]
# `result.show()` opens the `StepPlayer` on the engine that ran *your* policy, at the step
# where it first differs, with SPF's decisions beside yours:

# %%
# NBVAL_IGNORE_OUTPUT
result.show()

# %% [markdown]
# ## Starvation, measured
#
# `starvation` runs one overloaded workload (30 requests, prompts of 4 to 96 tokens) in the
# simulator under each policy and counts time to first token in steps. Here FCFS against the
# engine's SPF -- once yours passes, add it:

# %%
table = starvation({"fcfs": "fcfs", "spf": ex.reference("policy")})
table

# %% [markdown]
# SPF lowers the mean TTFT a little, but the quarter of requests with the longest prompts
# waits more than twice as long as under FCFS: while short prompts keep arriving, a long one
# keeps losing its turn. That is *starvation*.
#
# ## Your own policy
#
# Design a policy that keeps most of SPF's mean TTFT and bounds the long prompts' wait -- for
# example a key that ages: `num_prompt_tokens - AGE_WEIGHT * (steps waited)`. (Keys are taken
# when a request enters the queue, so ageing by `arrival_time` works: a smaller arrival time
# is an older request.) There is no reference for it: `starvation({"fcfs": "fcfs", "spf":
# ex.reference("policy"), "mine": MyPolicy})` is the measure.
