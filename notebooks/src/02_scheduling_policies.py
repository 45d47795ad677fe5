# %% [markdown]
# # Changing the scheduler's mind: policies you write in a notebook
#
# The scheduler asks a *policy* object two questions: in which order should waiting requests be
# admitted, and which running request should be preempted when the KV cache is full. This
# tutorial compares the built-in first-come-first-served policy with a policy written here, on
# the same requests, and plots when each request finished.

# %%
import matplotlib.pyplot as plt
from workbench import LLMEngine, SamplingParams
from workbench.core.policy import SchedulingPolicy

speech = {
    "KING HENRY": "Once more unto the breach, dear friends, once more; or close the wall up with our English dead. ",
    "MACBETH": "Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace from day to day. ",
    "PUCK": "If we shadows have offended, think but this, and all is mended. ",
}
long_prompts = [f"{name}:\n" + text * 4 for name, text in speech.items()]
prompts = [long_prompts[0], "ROMEO:", long_prompts[1], "LEAR:", long_prompts[2], "JULIET:"]


# %% [markdown]
# A policy is a small class. `sort_key` orders the waiting queue (smaller first). Here:
# shortest prompt first, which is what the built-in `"spf"` policy does, written out in full so
# you can see how little it takes.

# %%
class ShortestPromptFirst(SchedulingPolicy):
    name = "my-spf"

    def sort_key(self, request):
        return (request.num_prompt_tokens, request.arrival_time)


def run(policy):
    engine = LLMEngine(policy=policy, block_size=8, num_kv_blocks=128,
                       max_num_seqs=2, max_num_batched_tokens=16)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finished_at, texts = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] = out.outputs[0].text
            finished_at[out.request_id] = engine.history[-1].step
    return finished_at, texts


fcfs, fcfs_texts = run("fcfs")
spf, spf_texts = run(ShortestPromptFirst())
print("FCFS finish steps:", dict(sorted(fcfs.items())))
print("SPF  finish steps:", dict(sorted(spf.items())))

# %% [markdown]
# Three long prompts (about 80-100 tokens) alternate with three short ones, all queued at
# once; the engine runs at most two requests at a time and computes at most 16 tokens a step,
# so a long prompt takes several steps to prefill. FCFS serves them in arrival order, so the
# short requests wait behind the long prefills; shortest-prompt-first lets them through
# first. The mean step at which requests finish (latency counted in steps rather than seconds,
# so that the result is reproducible):

# %%
for name, done in (("FCFS", fcfs), ("SPF", spf)):
    print(f"{name}: mean finish step {sum(done.values()) / len(done):.2f}, last {max(done.values())}")

# %%
fig, ax = plt.subplots(figsize=(9, 3), layout="constrained")
ids = sorted(fcfs)
ax.barh([i + 0.2 for i in range(len(ids))], [fcfs[r] for r in ids], height=0.4, label="FCFS")
ax.barh([i - 0.2 for i in range(len(ids))], [spf[r] for r in ids], height=0.4, label="shortest prompt first")
ax.set_yticks(range(len(ids)), [f"{r} ({len(p)} chars)" for r, p in zip(ids, prompts)])
ax.set_title("Each request's finishing step under each policy")
ax.set_xlabel("step at which the request finished")
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
plt.show()

# %% [markdown]
# The generated text does not depend on the policy: scheduling changes *when* tokens are
# computed, never *which* tokens (greedy decoding, same model).

# %%
print("same texts under both policies:", fcfs_texts == spf_texts)
print(repr(spf_texts["r1"]))

# %% [markdown]
# ## Exercises
#
# 1. Write `LongestPromptFirst` (its `sort_key` returns `(-request.num_prompt_tokens,
#    request.arrival_time)`), pass it to `run(...)` and compare its mean finish step with FCFS.
# 2. Let four requests run at once (`max_num_seqs=4` in `run`): does shortest-prompt-first still
#    help the short requests, and by how much?
# 3. Give `run` a `max_num_batched_tokens` argument and find the budget at which the two
#    policies finish every request at the same step.
