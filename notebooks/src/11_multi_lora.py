# %% [markdown]
# # Multi-LoRA serving: many fine-tunes, one batch
#
# A LoRA adapter changes a model by a low-rank update `W + scale * B @ A` on some of its
# projections: a few hundred kilobytes instead of a new checkpoint. A server can therefore keep
# many adapters of one base model and run requests for *different* adapters in the *same*
# batch (S-LoRA, Punica): the base matmuls are shared, and each token adds its own adapter's
# `(x @ A.T) @ B.T`, picked by a slot index. In this tutorial you will
#
# * serve the two adapters shipped for the tiny model beside the base model, in one batch;
# * see that the prefix cache never shares a block between adapters;
# * watch the scheduler's `max_loras` cap skip requests, and measure what the cap costs.

# %%
%matplotlib inline

import pandas as pd
from workbench import LLMEngine, LoRARequest, SamplingParams, Workload, compare_runs, teaching_config
from workbench.model.loader import embedded_lora_path

errors = LoRARequest("errors", 1, str(embedded_lora_path("errors")))
timon = LoRARequest("timon", 2, str(embedded_lora_path("timon")))
engine = LLMEngine(teaching_config(enable_lora=True, max_loras=2))
greedy = SamplingParams(temperature=0, max_tokens=12)
engine

# %% [markdown]
# `errors` was trained (by `tools/train_tiny.py --lora`, with peft) on *The Comedy of Errors*,
# `timon` on *Timon of Athens*: two plays the base model never saw (`data/README.md` has their
# held-out losses). One prompt, three models: the base, and each adapter. The three requests
# run in the same steps.

# %%
prompt = "ADRIANA:\n"
for rid, lora in (("base", None), ("errors", errors), ("timon", timon)):
    engine.add_request(rid, prompt, greedy, lora_request=lora)
texts = {}
while engine.has_unfinished_requests():
    for out in engine.step():
        if out.finished:
            texts[out.request_id] = out.outputs[0].text
for rid, text in texts.items():
    print(f"{rid:>7}: {text!r}")

# %% [markdown]
# The first step's batch: three chunks, two of them under an adapter (`lora=`). The runner
# gave each token the slot of its request's adapter (0 for the base model) and every LoRA
# projection applied the update only to the tokens of its slots.

# %%
print(engine.history[0].scheduler_output)
print("adapters in host memory:", engine.list_loras())
print("device slots (adapter id -> slot):", engine.runner.lora_manager.active_adapters())

# %% [markdown]
# ## The prefix cache keys blocks by adapter
#
# The same tokens under two adapters have different keys and values, so they must never share
# a cached block. The adapter's name is one of every block's *extra keys* in its hash (as in
# vLLM). Run a long prompt under `errors`, then the same prompt under `errors` again, under
# `timon`, and with no adapter:

# %%
scene = "[Enter DROMIO of Syracuse.]\nDROMIO OF SYRACUSE:\nMaster, here's the goldsmith's man.\n"
hits = {}
for rid, lora in (("first", errors), ("again", errors), ("other", timon), ("plain", None)):
    engine.add_request(rid, scene, SamplingParams(max_tokens=1), lora_request=lora)
    engine.step()
    hits[rid] = engine.history[-1].scheduler_output.num_prefix_cache_hit_tokens
    while engine.has_unfinished_requests():
        engine.step()
hits

# %% [markdown]
# Only the second `errors` request found cached blocks. The hashes differ from the first
# block on, because the adapter's name enters every block's hash:

# %%
from workbench.core.kv_cache_utils import hash_request_blocks

ids = engine.tokenizer(scene).input_ids
for name in ("errors", "timon", None):
    print(f"{name!s:>6}", [h.hex()[:8] for h in hash_request_blocks(ids, engine.kv_cache.block_size, lora_name=name)][:3])

# %% [markdown]
# ## The `max_loras` cap
#
# The runner holds `max_loras` adapters in device slots. The scheduler therefore admits a
# waiting request only if its adapter is in the batch already, or the batch has room for one
# more; otherwise it *skips* it (it keeps its place in the queue, and requests behind it may
# go first, as in vLLM). A workload where requests cycle over base, `errors` and `timon`:

# %%
wl = Workload.poisson(num_requests=9, rate=3.0, input_len=(8, 24), output_len=(4, 10), seed=2)
wl = wl.with_lora_requests([None, errors, timon])
[(r.request_id, r.lora_request.lora_name if r.lora_request else None) for r in wl][:6]

# %%
cmp = compare_runs(wl, {"max_loras=1": {"max_loras": 1}, "max_loras=2": {"max_loras": 2}},
                   base=teaching_config(enable_lora=True))
rows = {}
for name, run in cmp.results.items():
    summary = run.summary()
    rows[name] = {
        "steps": summary["num_steps"],
        "skips (request-steps)": sum(len(r.scheduler_output.lora_skipped_request_ids) for r in run.history),
        "most adapters in a step": max(len(r.scheduler_output.lora_names) for r in run.history),
        "TTFT p50 (steps)": summary["ttft_steps_p50"],
        "e2e p90 (steps)": summary["e2e_steps_p90"],
    }
pd.DataFrame(rows)

# %% [markdown]
# With one slot, the requests of the other adapter wait until the batch has none of the first
# adapter's left: more steps, later first tokens. The player says why at each such step:

# %%
from workbench.viz import StepPlayer

run = cmp.results["max_loras=1"]
step = next(r.step for r in run.history if r.scheduler_output.lora_skipped_request_ids)
player = StepPlayer(run, live_updates=False)
player.show(step)
print(f"step {step}:", *[n for n in player.notes if "max_loras" in n], sep="\n  ")

# %% [markdown]
# Both runs' timelines on one step axis (each row a request, its adapter in brackets): with one
# slot, the requests of the two adapters take turns; with two, they share the batch.

# %%
from workbench.viz.comparison import aligned_timelines

aligned_timelines(cmp.results)

# %% [markdown]
# ## What an adapter costs per token
#
# The update of one projection `in -> out` at rank `r` is two small matmuls: `r * (in + out)`
# multiply-adds per token, against `in * out` for the base weight. For the `errors` adapter
# (rank 8 on all seven projections of the tiny model):

# %%
c = engine.model_config
shapes = {"q": (c.hidden_size, c.num_heads * c.head_dim), "k": (c.hidden_size, c.num_kv_heads * c.head_dim),
          "v": (c.hidden_size, c.num_kv_heads * c.head_dim), "o": (c.num_heads * c.head_dim, c.hidden_size),
          "gate": (c.hidden_size, c.intermediate_size), "up": (c.hidden_size, c.intermediate_size),
          "down": (c.intermediate_size, c.hidden_size)}
base = sum(i * o for i, o in shapes.values())
lora = sum(8 * (i + o) for i, o in shapes.values())
print(f"per layer and token: base {base:,} multiply-adds, LoRA rank 8 {lora:,} ({lora / base:.1%})")

# %% [markdown]
# A few percent of the arithmetic, but on a CPU each adapter in a batch is a separate pair of
# small matmuls per projection (the tokens grouped by slot), and on a GPU the Punica-style
# kernels (`kernels/triton_lora.py`) gather each token's adapter. The measured throughput with
# 0, 1 and 2 adapters in the batch against the base model comes from
# `workbench bench throughput --lora errors timon` (this machine's figures are in the README).
# The cell below times one mixed run here; its output is not checked.

# %%
# NBVAL_IGNORE_OUTPUT
import time

for loras in ([None], [errors], [errors, timon]):
    run_wl = wl.with_lora_requests(loras)
    t0 = time.perf_counter()
    result = compare_runs(run_wl, {"run": {"max_loras": 2}}, base=teaching_config(enable_lora=True))
    tokens = result.results["run"].summary()["output_tokens"]
    print(f"adapters {[l.lora_name if l else None for l in loras]}: {tokens / (time.perf_counter() - t0):.0f} tok/s")

# %% [markdown]
# ## Exercises
#
# 1. Pin `timon` (`engine.pin_lora(2)`) on an engine with `max_loras=1`: which requests can
#    still run, and what does `add_request` say about the others?
# 2. Rerun the comparison with `policy="spf"`: do the skips change, and why can a skipped
#    request still be overtaken by one with no adapter?
# 3. Train a third adapter (`python tools/train_tiny.py --lora two_gentlemen_of_verona --out /tmp/tg
#    --steps 60`) and serve all three with `max_loras=2` and `max_cpu_loras=2`: watch
#    `engine.list_loras()` as adapters are evicted from host memory and loaded again.
# 4. Merge an adapter into the weights with peft (`merge_and_unload`) and serve the merged model:
#    are the greedy tokens the same, and what does merging cost when two adapters share a batch?
