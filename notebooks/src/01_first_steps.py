# %% [markdown]
# # A request's life, one step at a time
#
# This tutorial runs the workbench's engine on the tiny Shakespeare model that ships in `data/`,
# first as vLLM's offline `LLM`, then one `step()` at a time, looking at what the scheduler
# decided, which KV blocks each request holds, and how the batch changed from step to step.
# Everything runs on a laptop CPU in a few seconds.

# %%
import matplotlib.pyplot as plt
from workbench import LLM, SamplingParams

llm = LLM(block_size=8, num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=32)
llm

# %% [markdown]
# `LLM()` with no model loads the embedded checkpoint. We asked for a deliberately small KV
# cache (8 blocks of 8 tokens) and a token budget of 32 per step, so that scheduling decisions
# become visible with a handful of requests. Greedy decoding (`temperature=0`) makes every output
# below reproducible.

# %%
greedy = SamplingParams(temperature=0, max_tokens=40)
out = llm.generate(["ROMEO:"], greedy, use_tqdm=False)[0]
print(out.prompt + out.outputs[0].text)
print(out.outputs[0].finish_reason, len(out.outputs[0].token_ids), "tokens")

# %% [markdown]
# ## Stepping the engine yourself
#
# `llm.engine` is the `LLMEngine` behind `LLM`. Add requests, then call `step()`: each call
# schedules one batch, runs the model once over it, samples one token for every request whose
# prompt is fully computed, and appends a `StepRecord` to `engine.history`.
#
# `history.clear()` forgets the steps the `generate` above took, but step numbers keep
# counting from the engine's first step (as vLLM's iteration counter does), so our first
# step is not step 0: every view says where the kept steps start and why.

# %%
engine = llm.engine
engine.history.clear()
prompts = {
    "hamlet": "HAMLET:\nTo be, or not to be, that is the question:",
    "juliet": "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "henry": "KING HENRY:\nOnce more unto the breach, dear friends, once more;",
}
for request_id, prompt in prompts.items():
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=24))
engine.scheduler

# %%
engine.step()
engine.history[-1]

# %% [markdown]
# The three prompts hold 17, 14 and 19 tokens, 50 in all, but a step may compute only 32.
# `hamlet` and `juliet` were prefilled whole (`P17`, `P14`); `henry` got the one token left in
# the budget, a *chunk* of its prompt (chunked prefill). Each request now owns KV blocks; the
# scheduler output lists every chunk with its token range and block table:

# %%
print(engine.history[-1].scheduler_output)

# %%
for _ in range(2):
    engine.step()
    print(engine.history[-1])

# %% [markdown]
# In the next step `hamlet` and `juliet` decode one token each (`D1`) while `henry` finishes
# its prefill (`P18`) in the same batch: vLLM's scheduler has no separate prefill and decode
# phases. The step after is three decodes. The KV cache shows who owns which block: all
# 8 blocks are taken, so the next request to fill its last block will need one that is not
# there.

# %%
{rid: engine.kv_cache.block_table(rid) for rid in engine.scheduler.requests}

# %% [markdown]
# `BlockMap` draws the pool: one cell per block, coloured by the request that owns it (each
# request keeps its colour in every view), with the number of tokens each block holds. Pick
# a block to see its hash and its tokens as text, or a request to highlight its block table.
# Below the widget, the text is what it holds; in JupyterLab you see the grid.

# %%
from workbench import BlockMap

block_map = BlockMap(engine)
block_map

# %% [markdown]
# Now run to the end. With only 8 blocks the three requests cannot all grow to their full
# length, so when a running request needs a block and none is free, the scheduler *preempts*
# the newest one: it frees that request's blocks, puts it back at the front of the waiting
# queue, and later recomputes it (prompt and the tokens it already generated) to resume. The
# prefix cache softens the blow: the preempted request's full blocks keep their hashes until
# they are reused, so on resuming it finds most of them again and recomputes only a few
# tokens.

# %%
results = {}
while engine.has_unfinished_requests():
    for out in engine.step():  # an output for every request that progressed
        if out.finished:
            results[out.request_id] = out
for rid, out in results.items():
    print(f"{rid:>7}: {out.outputs[0].finish_reason:6} {out.outputs[0].text!r}")
for record in engine.history:
    if record.scheduler_output.preempted_request_ids or record.scheduler_output.resumed_request_ids:
        print(record)

# %% [markdown]
# ## Scrubbing back
#
# Every step recorded what the scheduler decided and what the KV cache did, so the
# `StepPlayer` can show any past step as it was: the batch, the queues after it, what
# happened and why, and the block map of that moment. We open it at the first preemption;
# in JupyterLab the slider moves to any other step, and the text below is what the player
# shows at this one. It spans the steps recorded so far, as the timeline and the step plots
# below do (`live_updates=False`: the steps later cells take do not move it).

# %%
from workbench import StepPlayer

first_preemption = next(r.step for r in engine.history if r.scheduler_output.preempted_request_ids)
player = StepPlayer(engine, live_updates=False)  # the run as it is now: the steps below stay out
player.show(first_preemption)
player

# %%
for note in player.notes:
    print(note)
print("after the step:", player.queues)

# %% [markdown]
# The whole run at a glance: one row per request, from arrival to finish, with its prefill
# chunks, decodes, and the time it spent preempted.

# %%
from workbench import RequestTimeline

RequestTimeline(engine)

# %%
frame = engine.history.to_dataframe()
frame.loc[:, "num_seqs":"free_blocks"]

# %%
from workbench.viz import plot_kv_usage, plot_step_tokens

fig, axes = plt.subplots(1, 2, figsize=(13, 3.5), layout="constrained")
plot_step_tokens(engine.history, ax=axes[0])
plot_kv_usage(engine.history, ax=axes[1])
plt.show()

# %% [markdown]
# Every block is back in the free pool, and the blocks that held full prompt blocks keep
# their prefix hash: a new request that starts with the same text reuses them without
# recomputing (a *prefix-cache hit*).

# %%
engine.add_request("hamlet-again", prompts["hamlet"], SamplingParams(temperature=0, max_tokens=4))
engine.step()
record = engine.history[-1]
print(record)
print("prefix-cache hit tokens:", record.scheduler_output.num_prefix_cache_hit_tokens)
while engine.has_unfinished_requests():
    engine.step()

# %% [markdown]
# ## Timings
#
# Each record also keeps wall-clock timings of the step's stages. They differ from run to run,
# so this cell's output is not checked by the tests.

# %%
# NBVAL_IGNORE_OUTPUT
frame[[c for c in frame.columns if c.startswith("t_")]].describe().loc[["mean", "max"]]

# %% [markdown]
# ## Exercises
#
# 1. Give the engine twice the KV cache (`num_kv_blocks=16` in the first code cell) and run the
#    notebook again: which step records still mention `preempted`?
# 2. Halve the token budget (`max_num_batched_tokens=16`): in how many steps are the three
#    prompts prefilled now, and which request gets the chunks?
# 3. Add a fourth request with the same prompt as `juliet` before the first `step()`: how many
#    prefix-cache hit tokens does it get, and why not all of them?
