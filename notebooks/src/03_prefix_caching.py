# %% [markdown]
# # The paged KV cache and prefix caching
#
# The KV cache is a pool of fixed-size *blocks*; each request owns a *block table* that maps its
# token positions to blocks. A full block is also registered under a *prefix hash*: a sha256
# chained over (the previous block's hash, this block's token ids). A later request whose prompt
# starts with the same tokens finds those blocks by hash and skips recomputing them. This
# tutorial watches that happen, block by block.

# %%
import matplotlib.pyplot as plt
import pandas as pd
from workbench import LLMEngine, SamplingParams
from workbench.viz import plot_kv_blocks

engine = LLMEngine(block_size=8, num_kv_blocks=16, max_num_batched_tokens=64)
tokenizer = engine.tokenizer
scene = ("[Enter ROMEO and JULIET, in the orchard.]\n"
         "ROMEO:\nBut soft, what light through yonder window breaks?\n")
greedy = SamplingParams(temperature=0, max_tokens=8)
print(len(tokenizer(scene).input_ids), "tokens in the shared scene")

# %% [markdown]
# A first request: the scene, then a speaker. One step computes its whole prompt and writes
# its keys and values into blocks taken from the front of the free queue.

# %%
engine.add_request("first", scene + "JULIET:", greedy)
engine.step()
print(engine.kv_cache)
print("block table:", engine.kv_cache.block_table("first"))
engine.kv_cache.blocks[0]

# %% [markdown]
# Every full block carries its hash and the token ids it holds. Decoding them shows which
# piece of the prompt lives where (block 0 starts with the `<|bos|>` token):

# %%
for block_id in engine.kv_cache.block_table("first"):
    block = engine.kv_cache.blocks[block_id]
    print(block_id, block.block_hash is not None, repr(tokenizer.decode(block.token_ids)))

# %% [markdown]
# When the request finishes its blocks return to the free queue, *tail first*: the end of
# a sequence is the least likely to be shared, so it is the first to be reused. The full blocks
# keep their hashes (they are free but still *cached*) until a new allocation evicts them.

# %%
while engine.has_unfinished_requests():
    engine.step()
print(engine.kv_cache.pool.free_queue)
print(engine.kv_cache)

# %% [markdown]
# Now a second request with the same scene and another speaker. The scheduler looks its
# prompt up block by block and finds the first four: only the tokens after them are computed
# (`P` with a handful of tokens instead of the whole prompt).

# %%
engine.add_request("second", scene + "ROMEO:", greedy)
engine.step()
record = engine.history[-1]
print(record)
print("prefix-cache hit tokens:", record.scheduler_output.num_prefix_cache_hit_tokens)
print("block table:", engine.kv_cache.block_table("second"))

# %% [markdown]
# Two requests running at once share the cached blocks: each shared block's `ref_count`
# counts its owners, and a block returns to the free queue only when the last owner lets go.

# %%
engine.add_request("third", scene + "NURSE:", greedy)
engine.step()
shared = sorted(set(engine.kv_cache.block_table("second")) & set(engine.kv_cache.block_table("third")))
print("shared blocks:", shared)
print([engine.kv_cache.blocks[i].ref_count for i in shared])
plot_kv_blocks(engine.kv_cache, columns=8)
plt.show()

# %% [markdown]
# Cached blocks are evicted lazily: only when the free queue hands one out for new tokens is
# its hash dropped. Unrelated prompts that need most of the pool push the scene out, and the
# same prompt then finds nothing to reuse:

# %%
while engine.has_unfinished_requests():
    engine.step()
for i, speaker in enumerate(["HAMLET", "OTHELLO", "PORTIA"]):
    engine.add_request(f"other-{i}", f"{speaker}:\n" + "Now is the winter of our discontent. " * 4,
                       SamplingParams(temperature=0, max_tokens=4))
while engine.has_unfinished_requests():
    engine.step()
print("blocks evicted:", sum(r.scheduler_output.num_blocks_evicted for r in engine.history))
engine.add_request("again", scene + "JULIET:", greedy)
engine.step()
print("prefix-cache hit tokens now:", engine.history[-1].scheduler_output.num_prefix_cache_hit_tokens)
while engine.has_unfinished_requests():
    engine.step()
engine.kv_cache.prefix_cache_stats

# %% [markdown]
# ## Many users, one system prompt
#
# A chat service puts the same system prompt in front of every user's message. That is the
# prefix cache's best case: after the first request, every request finds the shared blocks.
# `Workload` builds such traffic: sixteen requests of 40 to 64 tokens (and a few output
# tokens each) arriving over eight steps, all starting with the same 32 tokens
# (`num_prefix_groups=1, prefix_len=32`). We run it with prefix caching on and off, and
# once with four different system prompts.

# %%
from workbench import Workload, run_workload

shape = dict(num_requests=16, rate=2.0, input_len=(40, 64), output_len=(2, 4), prefix_len=32, seed=3)
one_prompt = Workload.poisson(num_prefix_groups=1, **shape)
print(repr(one_prompt[0].prompt[:70]))
print(repr(one_prompt[1].prompt[:70]))
config = dict(block_size=8, num_kv_blocks=64, max_num_batched_tokens=64)
runs = {
    "one system prompt, caching on": (one_prompt, config),
    "one system prompt, caching off": (one_prompt, dict(config, enable_prefix_caching=False)),
    "four system prompts, caching on": (Workload.poisson(num_prefix_groups=4, **shape), config),
}
results = {name: run_workload(workload, engine_config) for name, (workload, engine_config) in runs.items()}
print("cached tokens per request, one system prompt:",
      results["one system prompt, caching on"].requests.num_cached_tokens.tolist())
pd.DataFrame.from_dict({
    name: {"hit rate": round(result.summary()["prefix_hit_rate"], 3),
           "prompt tokens": int(result.requests.num_prompt_tokens.sum()),
           "prefill tokens computed": int(result.history.to_dataframe().prefill_tokens.sum()),
           "steps": result.num_steps, "TTFT p50 (steps)": result.summary()["ttft_steps_p50"]}
    for name, result in results.items()
}, orient="index")

# %% [markdown]
# The *hit rate* is vLLM's: prompt tokens found in the cache over prompt tokens looked up.
# With one system prompt every request after the first two finds its 32 tokens (the
# second arrived in the same step as the first, before the first's blocks were computed),
# about half of all prompt tokens, so the engine computes half as many prefill tokens and
# first tokens come sooner. Four system prompts cost four first misses.

# %% [markdown]
# ## Exercises
#
# 1. Build the engine with `block_size=4`: how many prefix-cache hit tokens does `second` get
#    now, and why does a smaller block share more of the scene?
# 2. Build it with `enable_prefix_caching=False`: what does `second`'s first step compute, and
#    what does `engine.kv_cache.prefix_cache_stats` say at the end?
# 3. Give the pool 64 blocks (`num_kv_blocks=64`): are any blocks evicted by the three unrelated
#    prompts, and does `again` find the scene?
