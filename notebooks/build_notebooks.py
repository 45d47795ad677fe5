"""Write the tutorial notebooks from the cell lists below, then execute them in place.

    python notebooks/build_notebooks.py         # writes notebooks/*.ipynb and runs them (nbconvert)

The stored outputs are what nbval compares in CI, so every cell is deterministic (seeds,
greedy decoding, no timings) except those marked ``# NBVAL_IGNORE_OUTPUT``.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = pathlib.Path(__file__).resolve().parents[1]

FIRST_STEPS = [
    ("md", """# A request's life, one step at a time

This tutorial runs the workbench's engine on the tiny Shakespeare model that ships in `data/`,
first as vLLM's offline `LLM`, then one `step()` at a time, looking at what the scheduler
decided, which KV blocks each request holds, and how the batch changed from step to step.
Everything runs on a laptop CPU in a few seconds."""),
    ("code", """import matplotlib.pyplot as plt
from workbench import LLM, SamplingParams

llm = LLM(block_size=8, num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=32)
llm"""),
    ("md", """`LLM()` with no model loads the embedded checkpoint. We asked for a deliberately small KV
cache (8 blocks of 8 tokens) and a token budget of 32 per step, so that scheduling decisions
become visible with a handful of requests. Greedy decoding (`temperature=0`) makes every output
below reproducible."""),
    ("code", """greedy = SamplingParams(temperature=0, max_tokens=40)
out = llm.generate(["ROMEO:"], greedy, use_tqdm=False)[0]
print(out.prompt + out.outputs[0].text)
print(out.outputs[0].finish_reason, len(out.outputs[0].token_ids), "tokens")"""),
    ("md", """## Stepping the engine yourself

`llm.engine` is the `LLMEngine` behind `LLM`. Add requests, then call `step()`: each call
schedules one batch, runs the model once over it, samples one token for every request whose
prompt is fully computed, and appends a `StepRecord` to `engine.history`."""),
    ("code", """engine = llm.engine
engine.history.clear()
prompts = {
    "hamlet": "HAMLET:\\nTo be, or not to be, that is the question:",
    "juliet": "JULIET:\\nO Romeo, Romeo! wherefore art thou Romeo?",
    "henry": "KING HENRY:\\nOnce more unto the breach, dear friends, once more;",
}
for request_id, prompt in prompts.items():
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=24))
engine.scheduler"""),
    ("code", """engine.step()
engine.history[-1]"""),
    ("md", """The three prompts hold 17, 14 and 19 tokens, 50 in all, but a step may compute only 32.
`hamlet` and `juliet` were prefilled whole (`P17`, `P14`); `henry` got the one token left in
the budget, a *chunk* of its prompt (chunked prefill). Each request now owns KV blocks; the
scheduler output lists every chunk with its token range and block table:"""),
    ("code", """print(engine.history[-1].scheduler_output)"""),
    ("code", """for _ in range(2):
    engine.step()
    print(engine.history[-1])"""),
    ("md", """In the next step `hamlet` and `juliet` decode one token each (`D1`) while `henry` finishes
its prefill (`P18`) in the same batch: vLLM's scheduler has no separate prefill and decode
phases. The step after is three decodes. The KV cache shows who owns which block: all
8 blocks are taken, so the next request to fill its last block will need one that is not
there."""),
    ("code", """{rid: engine.kv_cache.block_table(rid) for rid in engine.scheduler.requests}"""),
    ("code", """from workbench.viz import plot_kv_blocks

plot_kv_blocks(engine.kv_cache, columns=12)
plt.show()"""),
    ("md", """Now run to the end. With only 8 blocks the three requests cannot all grow to their full
length, so when a running request needs a block and none is free, the scheduler *preempts*
the newest one: it frees that request's blocks, puts it back at the front of the waiting
queue, and later recomputes it (prompt and the tokens it already generated) to resume. The
prefix cache softens the blow: the preempted request's full blocks keep their hashes until
they are reused, so on resuming it finds most of them again and recomputes only a few
tokens."""),
    ("code", """results = {}
while engine.has_unfinished_requests():
    for out in engine.step():  # an output for every request that progressed
        if out.finished:
            results[out.request_id] = out
for rid, out in results.items():
    print(f"{rid:>7}: {out.outputs[0].finish_reason:6} {out.outputs[0].text!r}")
for record in engine.history:
    if record.scheduler_output.preempted_request_ids or record.scheduler_output.resumed_request_ids:
        print(record)"""),
    ("code", """frame = engine.history.to_dataframe()
frame.loc[:, "num_seqs":"free_blocks"]"""),
    ("code", """from workbench.viz import plot_kv_usage, plot_step_tokens

fig, axes = plt.subplots(1, 2, figsize=(13, 3.5), layout="constrained")
plot_step_tokens(engine.history, ax=axes[0])
plot_kv_usage(engine.history, ax=axes[1])
plt.show()"""),
    ("md", """Every block is back in the free pool, and the blocks that held full prompt blocks keep
their prefix hash: a new request that starts with the same text reuses them without
recomputing (a *prefix-cache hit*)."""),
    ("code", """engine.add_request("hamlet-again", prompts["hamlet"], SamplingParams(temperature=0, max_tokens=4))
engine.step()
record = engine.history[-1]
print(record)
print("prefix-cache hit tokens:", record.scheduler_output.num_prefix_cache_hit_tokens)
while engine.has_unfinished_requests():
    engine.step()"""),
    ("md", """## Timings

Each record also keeps wall-clock timings of the step's stages. They differ from run to run,
so this cell's output is not checked by the tests."""),
    ("code", """# NBVAL_IGNORE_OUTPUT
frame[[c for c in frame.columns if c.startswith("t_")]].describe().loc[["mean", "max"]]"""),
]

POLICIES = [
    ("md", """# Changing the scheduler's mind: policies you write in a notebook

The scheduler asks a *policy* object two questions: in which order should waiting requests be
admitted, and which running request should be preempted when the KV cache is full. This
tutorial compares the built-in first-come-first-served policy with a policy written here, on
the same requests, and plots when each request finished."""),
    ("code", """import matplotlib.pyplot as plt
from workbench import LLMEngine, SamplingParams
from workbench.core.policy import SchedulingPolicy

speech = {
    "KING HENRY": "Once more unto the breach, dear friends, once more; or close the wall up with our English dead. ",
    "MACBETH": "Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace from day to day. ",
    "PUCK": "If we shadows have offended, think but this, and all is mended. ",
}
long_prompts = [f"{name}:\\n" + text * 4 for name, text in speech.items()]
prompts = [long_prompts[0], "ROMEO:", long_prompts[1], "LEAR:", long_prompts[2], "JULIET:"]"""),
    ("md", """A policy is a small class. `sort_key` orders the waiting queue (smaller first). Here:
shortest prompt first, which is what the built-in `"spf"` policy does, written out in full so
you can see how little it takes."""),
    ("code", """class ShortestPromptFirst(SchedulingPolicy):
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
print("SPF  finish steps:", dict(sorted(spf.items())))"""),
    ("md", """Three long prompts (about 80-100 tokens) alternate with three short ones, all queued at
once; the engine runs at most two requests at a time and computes at most 16 tokens a step,
so a long prompt takes several steps to prefill. FCFS serves them in arrival order, so the
short requests wait behind the long prefills; shortest-prompt-first lets them through
first. The mean step at which requests finish (latency counted in steps rather than seconds,
so that the result is reproducible):"""),
    ("code", """for name, done in (("FCFS", fcfs), ("SPF", spf)):
    print(f"{name}: mean finish step {sum(done.values()) / len(done):.2f}, last {max(done.values())}")"""),
    ("code", """fig, ax = plt.subplots(figsize=(9, 3), layout="constrained")
ids = sorted(fcfs)
ax.barh([i + 0.2 for i in range(len(ids))], [fcfs[r] for r in ids], height=0.4, label="FCFS")
ax.barh([i - 0.2 for i in range(len(ids))], [spf[r] for r in ids], height=0.4, label="shortest prompt first")
ax.set_yticks(range(len(ids)), [f"{r} ({len(p)} chars)" for r, p in zip(ids, prompts)])
ax.set_title("Each request's finishing step under each policy")
ax.set_xlabel("step at which the request finished")
ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
plt.show()"""),
    ("md", """The generated text does not depend on the policy: scheduling changes *when* tokens are
computed, never *which* tokens (greedy decoding, same model)."""),
    ("code", """print("same texts under both policies:", fcfs_texts == spf_texts)
print(repr(spf_texts["r1"]))"""),
]

PREFIX_CACHING = [
    ("md", """# The paged KV cache and prefix caching

The KV cache is a pool of fixed-size *blocks*; each request owns a *block table* that maps its
token positions to blocks. A full block is also registered under a *prefix hash*: a sha256
chained over (the previous block's hash, this block's token ids). A later request whose prompt
starts with the same tokens finds those blocks by hash and skips recomputing them. This
tutorial watches that happen, block by block."""),
    ("code", """import matplotlib.pyplot as plt
from workbench import LLMEngine, SamplingParams
from workbench.viz import plot_kv_blocks

engine = LLMEngine(block_size=8, num_kv_blocks=16, max_num_batched_tokens=64)
tokenizer = engine.tokenizer
scene = ("[Enter ROMEO and JULIET, in the orchard.]\\n"
         "ROMEO:\\nBut soft, what light through yonder window breaks?\\n")
greedy = SamplingParams(temperature=0, max_tokens=8)
print(len(tokenizer(scene).input_ids), "tokens in the shared scene")"""),
    ("md", """A first request: the scene, then a speaker. One step computes its whole prompt and writes
its keys and values into blocks taken from the front of the free queue."""),
    ("code", """engine.add_request("first", scene + "JULIET:", greedy)
engine.step()
print(engine.kv_cache)
print("block table:", engine.kv_cache.block_table("first"))
engine.kv_cache.blocks[0]"""),
    ("md", """Every full block carries its hash and the token ids it holds. Decoding them shows which
piece of the prompt lives where (block 0 starts with the `<|bos|>` token):"""),
    ("code", """for block_id in engine.kv_cache.block_table("first"):
    block = engine.kv_cache.blocks[block_id]
    print(block_id, block.block_hash is not None, repr(tokenizer.decode(block.token_ids)))"""),
    ("md", """When the request finishes its blocks return to the free queue, *tail first*: the end of
a sequence is the least likely to be shared, so it is the first to be reused. The full blocks
keep their hashes (they are free but still *cached*) until a new allocation evicts them."""),
    ("code", """while engine.has_unfinished_requests():
    engine.step()
print(engine.kv_cache.pool.free_queue)
print(engine.kv_cache)"""),
    ("md", """Now a second request with the same scene and another speaker. The scheduler looks its
prompt up block by block and finds the first four: only the tokens after them are computed
(`P` with a handful of tokens instead of the whole prompt)."""),
    ("code", """engine.add_request("second", scene + "ROMEO:", greedy)
engine.step()
record = engine.history[-1]
print(record)
print("prefix-cache hit tokens:", record.scheduler_output.num_prefix_cache_hit_tokens)
print("block table:", engine.kv_cache.block_table("second"))"""),
    ("md", """Two requests running at once share the cached blocks: each shared block's `ref_count`
counts its owners, and a block returns to the free queue only when the last owner lets go."""),
    ("code", """engine.add_request("third", scene + "NURSE:", greedy)
engine.step()
shared = sorted(set(engine.kv_cache.block_table("second")) & set(engine.kv_cache.block_table("third")))
print("shared blocks:", shared)
print([engine.kv_cache.blocks[i].ref_count for i in shared])
plot_kv_blocks(engine.kv_cache, columns=8)
plt.show()"""),
    ("md", """Cached blocks are evicted lazily: only when the free queue hands one out for new tokens is
its hash dropped. Unrelated prompts that need most of the pool push the scene out, and the
same prompt then finds nothing to reuse:"""),
    ("code", """while engine.has_unfinished_requests():
    engine.step()
for i, speaker in enumerate(["HAMLET", "OTHELLO", "PORTIA"]):
    engine.add_request(f"other-{i}", f"{speaker}:\\n" + "Now is the winter of our discontent. " * 4,
                       SamplingParams(temperature=0, max_tokens=4))
while engine.has_unfinished_requests():
    engine.step()
print("blocks evicted:", sum(r.scheduler_output.num_blocks_evicted for r in engine.history))
engine.add_request("again", scene + "JULIET:", greedy)
engine.step()
print("prefix-cache hit tokens now:", engine.history[-1].scheduler_output.num_prefix_cache_hit_tokens)
while engine.has_unfinished_requests():
    engine.step()
engine.kv_cache.prefix_cache_stats"""),
]

NOTEBOOKS = {
    "01_first_steps.ipynb": FIRST_STEPS,
    "02_scheduling_policies.ipynb": POLICIES,
    "03_prefix_caching.ipynb": PREFIX_CACHING,
}


def build(name: str, cells) -> pathlib.Path:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [new_markdown_cell(src) if kind == "md" else new_code_cell(src) for kind, src in cells]
    for i, cell in enumerate(nb.cells):  # stable ids: a rebuild only changes what really changed
        cell.id = f"cell-{i:02d}"
    path = ROOT / "notebooks" / name
    nbformat.write(nb, path)
    return path


def main() -> int:
    names = sys.argv[1:] or list(NOTEBOOKS)
    for name in names:
        path = build(name, NOTEBOOKS[name])
        subprocess.run(
            [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
             "--inplace", str(path)],
            check=True,
        )
        executed = nbformat.read(path, as_version=4)
        for cell in executed.cells:  # drop per-run timestamps
            cell.metadata.pop("execution", None)
        nbformat.write(executed, path)
        print("wrote", path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
