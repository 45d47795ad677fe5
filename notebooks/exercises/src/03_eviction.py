# %% [markdown]
# # Exercise 3: the prefix cache's eviction order
#
# A KV block whose last user finished is not wiped: it stays in the prefix cache, so a later
# prompt that starts with the same tokens reuses its K/V (a *prefix hit*). It is only evicted
# when the pool runs out of never-used blocks and needs it for new content. Which cached block
# goes first is decided by one data structure, vLLM's *free-block queue*. You write it; the
# grader replays every step of the engine on your queue and checks that it hands out the block
# the engine hands out, every time.
#
# ## The rule (vLLM v1's)
#
# * The free blocks wait in a queue; a new block is taken from the **front** (`popleft`),
#   evicting whatever it caches. All blocks start free, in id order.
# * A released block joins the **back**, so the block freed longest ago is evicted first
#   (least recently used).
# * When a request finishes (or is preempted), its blocks are released together -- **tail
#   first**: its last block joins the queue first and is evicted first. A request's last
#   blocks hold its own suffix, the least likely to be shared; its first blocks may hold a
#   system prompt many requests share, which should stay cached longest.
# * A prefix hit on a free block takes it back into use: it leaves the queue (`remove`),
#   wherever it is.

# %%
import workbench.exercises as ex
from workbench.exercises.eviction import EvictionWorkload

# Blocks of 2 tokens, a pool of 4. r1 shares r0's first four tokens (two full blocks).
shared = EvictionWorkload(num_blocks=4, max_num_seqs=2, requests=(
    ("r0", 0, (10, 11, 12, 13, 14), 1),
    ("r1", 1, (10, 11, 12, 13, 30), 1),
    ("r2", 2, (40, 41, 42, 43, 44), 1),
))
print(shared)

# %% [markdown]
# Worked by hand: r0 takes blocks 0, 1, 2 and finishes; they are released tail first, so the
# queue is `[3, 2, 1, 0]`. r1 hits blocks 0 and 1 (they leave the queue) and takes block 3 for
# its last token; released tail first, the queue becomes `[2, 3, 1, 0]`. r2 shares nothing and
# needs three blocks: 2, 3 and 1 -- evicting block 1's cached `[12, 13]`, while block 0 (the
# shared start `[10, 11]`) survives.
#
# ## Your code
#
# Fill in the class. `__iter__` is optional: when it yields your queue (front first) the
# grader shows it beside the engine's.

# %%
class FreeBlockQueue:
    """The free KV blocks (block ids) in eviction order."""

    def __init__(self, block_ids):
        """Every block starts free, in id order: block 0 is evicted first."""
        # your code here

    def free(self, block_ids):
        """A request released these blocks (in its block-table order); none has a user now."""
        # your code here

    def remove(self, block_id):
        """A prefix-cache hit takes this free block back into use."""
        # your code here

    def popleft(self):
        """The next block to reuse (its cached content is evicted): return its id."""
        # your code here

    def __iter__(self):
        """Optional: the queue, next evicted first (the grader shows it)."""
        return iter(())


# %% [markdown]
# ## Check it
#
# On the worked example first, then on drawn workloads. The stub's `popleft` returns None:

# %%
print(ex.check("eviction", FreeBlockQueue, workloads=[shared]))

# %%
result = ex.check("eviction", FreeBlockQueue)
result

# %%
print(result.hint())

# %% [markdown]
# `result.show()` opens the `StepPlayer` at that step (its block map shows the pool as the
# engine left it) with the block the engine took beside yours:

# %%
# NBVAL_IGNORE_OUTPUT
result.show()

# %% [markdown]
# ## When it passes
#
# `check` prints `PASSED eviction: ...`. Then try the other order -- release a request's
# blocks head first -- on `shared` with a fourth request that shares r0's start: which prefix
# hits does it lose? (`ex.reference("eviction")` is the engine's own queue, built on
# `workbench.core.block_pool.FreeBlockQueue`.)
