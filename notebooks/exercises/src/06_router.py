# %% [markdown]
# # Exercise 6: a prefix-aware router
#
# A cluster runs several engines (replicas) behind a router. Each replica keeps its own prefix
# cache, so where a request goes decides whether its prompt's opening -- a system prompt many
# requests share -- is found cached (its prefill skipped) or computed again. You write the
# router's decision; the grader runs a small simulated cluster (`Cluster.simulated`) on drawn
# shared-prefix workloads with your function routing, asks the cluster's own router beside it at
# every arrival, and names the first decision that differs.
#
# ## The rule
#
# * A prompt is cut into KV blocks of 4 tokens; each full block has a hash that names the block
#   *and everything before it* (vLLM's chained block hash). A replica can reuse a prompt's
#   blocks only from the first one on, up to the first block it does not hold: its **cached
#   prefix**.
# * Send the request to the replica holding the **longest cached prefix** (the most leading
#   blocks), even if its queue is longer.
# * Among replicas holding equally many (often none), send it to the one with the **fewest
#   waiting requests**. Replicas still tied are all right answers.
#
# The reference is the cluster's `PrecisePrefix` router (llm-d's precise prefix-cache scorer:
# what each replica caches is read from the KV events it publishes, vLLM's `BlockStored` /
# `BlockRemoved`) with only its prefix and queue scorers, the prefix weighted so that it
# always decides first; it draws among the remaining ties at random.

# %%
import workbench.exercises as ex
from workbench.exercises.routing import RoutingWorkload
from workbench.lab.workload import Workload, WorkloadRequest
from workbench.sampling_params import SamplingParams


def request(rid, tokens, arrival):
    return WorkloadRequest(rid, tuple(tokens), SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False),
                           arrival_time=arrival)


A, B = list(range(10, 18)), list(range(20, 28))  # two system prompts of two blocks each
hand = RoutingWorkload(2, 16, Workload([request("r0", A + [50], 0.0), request("r1", B + [51], 0.0),
                                        request("r2", B + [52], 1.0)], clock="wall"), "worked by hand")
print(hand)

# %% [markdown]
# Worked by hand: r0 and r1 arrive together. r0 finds both replicas empty and idle: either is
# right. Say it goes to replica 0; then r1 finds nothing cached anywhere and r0 waiting on
# replica 0, so it goes to replica 1. By the time r2 arrives (1 s later) both have finished:
# replica 0 caches A's two blocks, replica 1 caches B's. r2 opens with B: replica 1, where both
# its blocks are a prefix hit.
#
# ## Your code
#
# `cached[i]` is a set of block hashes (compare `prompt_blocks[k] in cached[i]`); return an
# index into the lists.

# %%
def route(prompt_blocks, cached, waiting):
    """The replica (its index) an arriving request is sent to.

    prompt_blocks: the hashes of the prompt's full KV blocks, first block first (a block's
    hash names its whole prefix). cached: one set per replica, the block hashes its prefix
    cache holds now. waiting: one int per replica, the requests in its waiting queue.
    """
    # your code here
    return 0


# %% [markdown]
# ## Check it
#
# On the worked example first, then on drawn workloads. The stub sends everything to
# replica 0:

# %%
print(ex.check("router", route, workloads=[hand]))

# %%
result = ex.check("router", route)
result

# %%
print(result.hint())

# %% [markdown]
# `result.show()` shows the decision: where the reference sends the request, where yours does,
# and what each replica holds of its prompt.

# %%
# NBVAL_IGNORE_OUTPUT
result.show()

# %% [markdown]
# ## When it passes
#
# `check` prints `PASSED router: ...` and the effect of your router in the simulator: on a
# larger workload (twelve 192-token system prompts over four replicas whose caches cannot hold
# them all), its prefix hit rate and TTFT beside the reference's and round robin's. If yours
# breaks the last ties by the lowest index, compare it with the reference's random draw: which
# replica gets every cold request? (`Cluster.simulated(4, router=...)` and
# `workbench.cluster.routers` hold the other routers to try.)
