# %% [markdown]
# # Async scheduling: deciding step N+1 while step N runs
#
# Every step has host work around its forward pass: the scheduler decides the batch, the
# runner packs it, and after sampling the scheduler updates each request, the output
# processor detokenizes and the step is recorded. Run one after the other, the device idles
# during all of it. vLLM's `--async-scheduling` hides most of it: the engine *schedules step
# N+1 while step N executes* (a batch queue of two: `EngineCore.step_with_batch_queue`), and
# the scheduler (`AsyncScheduler`) plans with tokens it does not know yet. You will:
#
# - turn it on (`EngineArgs(async_scheduling=True)`, `--async-scheduling`, `%llm load
#   --async-scheduling`) and check the tokens do not change;
# - see the *placeholder*: the input token of a step that the previous step is still sampling;
# - see a stop found one step late, in the `StepPlayer`;
# - see the host work of step N+1 drawn under the forward of step N;
# - meet what async scheduling needs the host for, and what vLLM refuses with it.

# %%
import matplotlib.pyplot as plt

from workbench import EngineArgs, LLMEngine, SamplingParams
from workbench.config import teaching_config
from workbench.viz import StepPlayer
from workbench.viz.overlap import draw_overlap


def run(engine, requests):
    """Add the requests, step to the end; each request's tokens and finish reason."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
    return done


REQUESTS = [
    ("stop", "ROMEO:", SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[201])),
    ("long", "JULIET:\nO Romeo, Romeo!", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
    ("lear", "LEAR:", SamplingParams(temperature=0, max_tokens=8)),
]

# %% [markdown]
# ## The same tokens, one step ahead
#
# Two teaching engines (a small pool: chunked prefill shows), one synchronous, one with async
# scheduling, get the same three requests. `stop` ends at its first newline (token 201, a
# stop token), `long` runs to `max_tokens`. Greedy tokens are the same: async scheduling
# changes *when* the host decides, never what the model computes.

# %%
sync = LLMEngine(teaching_config())
engine = LLMEngine(teaching_config(async_scheduling=True))
print(run(sync, REQUESTS) == run(engine, REQUESTS))
print(len(sync.history), "steps synchronous,", len(engine.history), "with async scheduling")

# %% [markdown]
# ## The placeholder
#
# When step N+1 is scheduled, step N's token is still being sampled, so the scheduler counts
# it as a *placeholder* (vLLM's `num_output_placeholders`) and schedules the next decode
# anyway; the chunk's input token is `-1`. The runner executes batches in order on a worker
# thread, so when step N+1 starts, step N's token is known there and fills the placeholder:
# the record's `SchedulerOutput` keeps the `-1`, the packed batch holds the real token.
# `StepRecord.overlap` says, per step, which requests had a placeholder.

# %%
record = engine.history[6]
print("placeholders:", record.overlap.placeholders)
for chunk in record.scheduler_output.scheduled:
    print(f"{chunk.request_id:5s} scheduled input {list(chunk.token_ids)[-3:]}")
print("the batch's inputs:", record.batch.input_ids.tolist()[-3:])

# %% [markdown]
# The prefix cache only takes blocks of tokens that are known *and* computed
# (`num_computed_tokens - num_output_placeholders`): a block holding a placeholder's position
# is never shared. And a request whose known plus in-flight tokens reach `max_tokens` is not
# scheduled again, so `long` never wastes a step.
#
# ## A stop found one step late
#
# A stop that only the sampled token reveals (eos, a stop token, a stop string, a grammar's
# end) is found when step N is updated, and by then step N+1, already running, has computed
# one more token for the finished request. That token is dropped. The player says so at that
# step (`discarded` in the record).

# %%
late = next(r.step for r in engine.history if r.overlap.discarded)
player = StepPlayer(engine, controls=False)
player.show(late)
player

# %%
for note in player.notes:
    print(note)

# %% [markdown]
# ## Host work under the forward
#
# Each record keeps the spans of its step: its `schedule`, the engine thread's `wait` for its
# batch and its `update` (update, outputs, record) on the engine thread, its `forward` on the
# worker. Drawn on one axis, every step's schedule sits under the previous step's forward (the
# same two tracks are in the Perfetto export, `engine.history.to_perfetto(...)`). On this
# tiny model the host work is a small share of a step, so the grey `wait` dominates: the
# engine thread has nothing left to do but wait for the forward.

# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(10, 2.4), layout="constrained")
draw_overlap(ax, list(engine.history))

# %% [markdown]
# ## What needs the host
#
# Some requests cannot sample step N+1 before step N's token is on the host: a grammar must
# advance on it (structured outputs), penalties and `min_tokens` read the output so far. For
# those the batch waits for step N's update (vLLM defers the grammar bitmask the same way);
# the record lists them as `deferred`. Speculative decoding with a proposer that reads the
# host's tokens (n-gram) is refused, with vLLM's message.

# %%
penalized = LLMEngine(teaching_config(async_scheduling=True))
run(penalized, [("p", "ROMEO:", SamplingParams(temperature=0, max_tokens=6, presence_penalty=1.0)),
                ("g", "LEAR:", SamplingParams(temperature=0, max_tokens=6))])
print(sorted({rid for r in penalized.history for rid in r.overlap.deferred}))
try:
    EngineArgs(async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
except ValueError as exc:
    print(exc)

# %% [markdown]
# ## Does it pay here?
#
# The overlap can only win back the host time per step, and here it costs something too: on a
# CPU the forward on the worker thread is Python dispatching many small torch ops, which
# contends with the engine thread's own Python for the GIL and for the cores. On this
# project's 2-vCPU VM async scheduling measured 1.4-1.5x *slower* (`workbench bench
# throughput --async-scheduling`, docs/performance.md), so the synchronous step stays the
# default; it pays where the forward runs on a device and the host work is a larger share of
# a step. Below, the same 24 requests on the default engine, both ways (wall-clock figures:
# they change from run to run and from machine to machine).

# %%
# NBVAL_IGNORE_OUTPUT
import time

work = [(f"r{i}", f"ROMEO {i}:", SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)) for i in range(24)]
for async_scheduling in (False, True):
    eng = LLMEngine(async_scheduling=async_scheduling, device="cpu")
    run(eng, work[:4])  # warm-up
    start = time.perf_counter()
    run(eng, [(f"b{rid}", p, s) for rid, p, s in work])
    print(f"async_scheduling={async_scheduling}: {24 * 32 / (time.perf_counter() - start):.0f} tok/s")

# %% [markdown]
# ## Exercises
#
# 1. Give `stop` a stop *string* instead (`stop=["\n"]`, no stop token): the output processor
#    finds it after the step's update. In which step's record is its token dropped now?
# 2. Add a request with `structured_outputs` (a JSON schema): which steps list it as
#    `deferred`, and how much of the overlap does it cost in the figure?
# 3. Run the same requests with a runner whose forward takes longer (a subclass of
#    `ModelRunner` whose `execute` sleeps 20 ms, `LLMEngine(make_runner=...)`): where do the
#    schedules fall in the figure now, and what does that say about a GPU's forward?
