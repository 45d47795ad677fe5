# %% [markdown]
# # Sampling: from logits to a token
#
# Each step the model gives every request a vector of *logits*, one score per token of the
# vocabulary. The sampler turns that vector into one token, in a fixed order (vLLM's, spelled
# out at the top of `workbench/worker/sampler.py`): the request's own logits processors and logit
# bias, penalties for tokens already seen, temperature, then the truncations min-p, top-k and
# top-p, then a random draw. This tutorial applies each stage to the real logits of one step
# of the embedded model and draws what it does. You will see:
#
# - how to read a step's logits with a per-request logits processor;
# - how temperature sharpens or flattens the distribution;
# - which tokens top-k, top-p and min-p keep, and how much probability each throws away;
# - how repetition, frequency and presence penalties push back on tokens already used;
# - how `logit_bias`, `allowed_token_ids` and `bad_words` steer the choice;
# - why a per-request `seed` gives the same tokens whatever else shares the batch.

# %%
import matplotlib.pyplot as plt
import torch

from workbench import LLMEngine, SamplingParams
from workbench.request import Request
from workbench.worker.sampler import apply_min_p, apply_penalties, apply_top_k_top_p

engine = LLMEngine(block_size=8, num_kv_blocks=64)
tokenizer = engine.tokenizer
VOCAB = engine.model_config.vocab_size


def generate(requests):
    """Run {request_id: (prompt, SamplingParams)} to completion; return each final output, in order."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    return {request_id: finished[request_id] for request_id in requests}


def next_token_logits(prompt):
    """The logits the sampler receives for the token after `prompt`, from one engine step.

    A request's `logits_processors` (vLLM's `fn(output_token_ids, logits) -> logits`) are the
    first thing the sampler applies to its row of logits; this one keeps a copy and changes
    nothing.
    """
    seen = []

    def keep_a_copy(output_token_ids, logits):
        seen.append(logits.clone())
        return logits

    params = SamplingParams(temperature=0, max_tokens=1, logits_processors=[keep_a_copy])
    generate({"probe": (prompt, params)})
    return seen[0]


def label(token_id):
    return repr(tokenizer.decode([token_id]))

# %% [markdown]
# ## One step's distribution
#
# Romeo has said "I love thee" twice; what comes after the third "I"? The engine computes the
# prompt, and the sampler sees one row of 4096 logits. Softmax turns them into probabilities:
# no token is very likely, and a long tail of unlikely tokens shares the rest.

# %%
prompt = "ROMEO:\nI love thee, I love thee, I"
logits = next_token_logits(prompt)
print("logits:", tuple(logits.shape), logits.dtype)
probs = logits.softmax(-1)
top = probs.topk(12)
for p, t in zip(top.values.tolist(), top.indices.tolist()):
    print(f"{label(t):10} {p:.3f}")
print(f"the 12 most likely tokens hold {top.values.sum():.2f} of the probability")

# %% [markdown]
# ## Temperature
#
# The sampler divides the logits by the temperature before the softmax. Below 1 the likely
# tokens get likelier (at 0 the sampler simply takes the argmax: greedy); above 1 the
# distribution flattens towards the tail. *Entropy* (in bits) measures how spread out it is.

# %%
def entropy_bits(p):
    p = p[p > 0]
    return float(-(p * p.log2()).sum())


ids = top.indices.tolist()
fig, ax = plt.subplots(figsize=(10, 3.2), layout="constrained")
for k, temperature in enumerate((0.5, 1.0, 2.0)):
    p = (logits / temperature).softmax(-1)
    ax.bar([i + (k - 1) * 0.27 for i in range(len(ids))], p[ids], width=0.27,
           label=f"T={temperature}: top token {p.max():.2f}, entropy {entropy_bits(p):.1f} bits")
ax.set_xticks(range(len(ids)), [label(t) for t in ids])
ax.set_ylabel("probability")
ax.set_title("The 12 most likely next tokens at three temperatures")
ax.legend()
plt.show()

# %% [markdown]
# ## Truncation: top-k, top-p, min-p
#
# Truncation removes the tail before the draw, so that one unlucky draw cannot pick a token
# the model barely considered. The engine's own functions do it on a batch of rows:
#
# - **top-k** keeps the k most likely tokens;
# - **top-p** (nucleus) keeps the smallest set of most likely tokens whose probability reaches p;
# - **min-p** keeps the tokens at least `min_p` times as likely as the most likely one, so it
#   keeps few tokens when the model is sure and many when it is not.

# %%
row = logits[None]  # a batch of one row, as the sampler sees it
kept = {
    "top_k=10": apply_top_k_top_p(row, torch.tensor([10]), torch.tensor([1.0]))[0],
    "top_p=0.5": apply_top_k_top_p(row, torch.tensor([VOCAB]), torch.tensor([0.5]))[0],
    "min_p=0.2": apply_min_p(row, torch.tensor([0.2]))[0],
}
order = probs.argsort(descending=True)[:60]
fig, axes = plt.subplots(1, 3, figsize=(13, 3), sharey=True, layout="constrained")
for ax, (name, filtered) in zip(axes, kept.items()):
    survives = torch.isfinite(filtered)
    ax.bar(range(60), probs[order], color=["tab:blue" if s else "lightgray" for s in survives[order]])
    ax.set_title(f"{name}: keeps {int(survives.sum())} tokens, {probs[survives].sum():.2f} of the mass")
    ax.set_xlabel("tokens, most likely first")
axes[0].set_ylabel("probability")
plt.show()
for name, filtered in kept.items():
    survivors = [t for t in order.tolist() if torch.isfinite(filtered[t])]
    print(f"{name:10} keeps {[tokenizer.decode([t]) for t in survivors]}")

# %% [markdown]
# The kept tokens are then renormalised and one is drawn. Here the three filters keep about
# the same dozen tokens, because this distribution has a flat tail; without any of them,
# about every other draw (0.48 of the mass) would pick a token outside the 12 printed above.
#
# ## Penalties
#
# Small models, greedy ones especially, repeat themselves. Greedy decoding after Juliet's
# question loops on one line:

# %%
juliet = "JULIET:\nO Romeo, Romeo, wherefore art thou"
greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
looping = generate({"greedy": (juliet, greedy)})["greedy"]
print(repr(looping.text))

# %% [markdown]
# Penalties lower the logits of tokens that were already used: `frequency_penalty` subtracts
# its value once per earlier occurrence in the *output*, `presence_penalty` once if the token
# occurred at all, `repetition_penalty` divides a positive logit (multiplies a negative one)
# of any token seen in the prompt *or* the output. Here is the step where the loop starts
# again: the model ended its scene (`<|eos|>`, which `ignore_eos` lets through), began a new
# one, and wants to repeat `I am not well`. We build the request as the scheduler holds it
# and apply the engine's penalty function to that step's distribution:

# %%
cut = looping.token_ids.index(tokenizer.encode(" am", add_special_tokens=False)[0], 10)
prompt_ids = tokenizer(juliet).input_ids
history_ids = looping.token_ids[:cut]
print("generated so far:", repr(tokenizer.decode(history_ids)))
step_logits = next_token_logits(prompt_ids + history_ids)

candidates = step_logits.topk(8).indices.tolist()
fig, ax = plt.subplots(figsize=(10, 3), layout="constrained")
settings = {"no penalty": {}, "frequency_penalty=1": {"frequency_penalty": 1.0},
            "presence_penalty=1.5": {"presence_penalty": 1.5},
            "repetition_penalty=1.2": {"repetition_penalty": 1.2}}
width = 0.8 / len(settings)
for k, (name, options) in enumerate(settings.items()):
    request = Request("demo", prompt_ids, SamplingParams(**options), output_token_ids=list(history_ids))
    penalised = step_logits[None].clone()
    apply_penalties(penalised, [request])
    p = penalised[0].softmax(-1)
    ax.bar([i + (k - 1.5) * width for i in range(len(candidates))], p[candidates], width=width,
           label=f"{name}: picks {label(int(p.argmax()))}")
ax.set_xticks(range(len(candidates)), [label(t) for t in candidates])
ax.set_ylabel("probability")
ax.set_title("The step before the loop repeats, with and without penalties")
ax.legend()
plt.show()

# %% [markdown]
# The same penalties over a whole generation break the loop:

# %%
runs = generate({
    name: (juliet, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **options))
    for name, options in settings.items()
})
for name, out in runs.items():
    print(f"{name:22} {out.text!r}")

# %% [markdown]
# ## Steering: logit bias, allowed tokens, bad words
#
# `logit_bias` (OpenAI's and vLLM's `{token id: bias}`, biases in [-100, 100]) is added to
# the logits before anything else; +100 all but forces a token, -100 all but bans it.
# `allowed_token_ids` masks every other token, and `bad_words` bans a word (the last token
# of each of its tokenizations, once the tokens before it have been generated). Back to Romeo:

# %%
love = tokenizer.encode(" love", add_special_tokens=False)[0]
am = tokenizer.encode(" am", add_special_tokens=False)[0]
for bias in (0.0, 2.0, 5.0):
    p = (logits + torch.nn.functional.one_hot(torch.tensor(love), VOCAB) * bias).softmax(-1)
    print(f"logit_bias {{' love': {bias:+}}}: P(' love') = {p[love]:.3f}, most likely {label(int(p.argmax()))}")

steered = generate({
    "plain": (prompt, SamplingParams(temperature=0, max_tokens=12)),
    "biased": (prompt, SamplingParams(temperature=0, max_tokens=12, logit_bias={love: 5.0})),
    "no ' am'": (prompt, SamplingParams(temperature=0, max_tokens=12, logit_bias={am: -100})),
    "bad_words": (prompt, SamplingParams(temperature=0, max_tokens=12, bad_words=["am", "not"])),
})
for name, out in steered.items():
    print(f"{name:10} {out.text!r}")

# %% [markdown]
# ## Seeds: the same tokens whatever shares the batch
#
# A sampled (temperature > 0) request draws random numbers. If all requests drew from one
# shared generator, a request's tokens would depend on how many other requests were in its
# batches and in which order: rerunning it under a different load would give different
# text. A request with its own `seed` draws from its own generator, so its tokens depend only
# on its own logits. We run a seeded request alone, then next to three unseeded ones:

# %%
seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
unseeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True)
alone = generate({"romeo": (prompt, seeded), "romeo-unseeded": (prompt, unseeded)})
crowd = generate({
    "other-1": ("HAMLET:\n", unseeded),
    "romeo": (prompt, seeded),
    "other-2": ("KING LEAR:\nBlow, winds", unseeded),
    "romeo-unseeded": (prompt, unseeded),
})
print("seeded, alone:    ", repr(alone["romeo"].text))
print("seeded, in crowd: ", repr(crowd["romeo"].text))
print("unseeded, alone:  ", repr(alone["romeo-unseeded"].text))
print("unseeded, crowd:  ", repr(crowd["romeo-unseeded"].text))
print("seeded request unchanged by the crowd:", alone["romeo"].token_ids == crowd["romeo"].token_ids)

# %% [markdown]
# The seeded request produced the same 24 tokens both times; the unseeded one changed,
# because its draws now came from a generator the other requests also drew from. Servers
# pass `seed` through from the OpenAI API's `seed` field for exactly this reason.

# %% [markdown]
# ## Beam search: several sequences, driven above the engine
#
# Greedy decoding commits to the likeliest token at each step; beam search keeps the
# `beam_width` likeliest *sequences*. vLLM runs it above the engine, and so does
# `LLM.beam_search` here (`workbench/entrypoints/beam_search.py`): each step adds one ordinary
# request per live beam, its prompt the beam's tokens, with `max_tokens=1` and
# `logprobs=2 * beam_width`. Every beam-plus-token candidate is ranked by its cumulative
# logprob and the best `beam_width` live on; a candidate ending in EOS is finished. At the
# end, finished and live beams are ranked by `cum_logprob / len ** length_penalty` (the length
# counts the prompt, as vLLM's). As in vLLM's `LLM.beam_search`, a beam's `text` decodes all
# its tokens, the prompt and special tokens included.

# %%
from workbench import LLM, BlockMap
from workbench.entrypoints.beam_search import get_beam_search_score
from workbench.sampling_params import BeamSearchParams

beam_llm = LLM(block_size=4, num_kv_blocks=64)
romeo = "ROMEO:\nI love thee"
(result,) = beam_llm.beam_search([romeo], BeamSearchParams(beam_width=3, max_tokens=8))
eos = beam_llm.get_tokenizer().eos_token_id
for beam in result.sequences:
    score = get_beam_search_score(beam.tokens, beam.cum_logprob, eos)
    print(f"cum_logprob {beam.cum_logprob:7.3f}  score {score:7.4f}  {beam.finish_reason:6}  {beam.text!r}")
greedy = beam_llm.generate([romeo], SamplingParams(temperature=0, max_tokens=8, logprobs=0),
                           use_tqdm=False)[0].outputs[0]
print(f"greedy: cum_logprob {greedy.cumulative_logprob:7.3f}  {greedy.text!r}")

# %% [markdown]
# The engine saw eight steps of one-token requests. The beams of a search share their
# prefix, so each step's requests find in the prefix cache the full blocks the step before
# computed (the blocks are free again between steps, but keep their hashes). While a step
# runs, the beams that share a prefix hold its blocks together: `ref_count` > 1, rising when
# more beams descend from the prefix a block holds (block 3 at step 7 below) and falling
# when such beams are pruned.
# `kv_state(step, during_forward=True)` rebuilds the pool as the step's forward pass saw it.

# %%
history = beam_llm.engine.history
for record in list(history)[:8]:
    during = history.kv_state(record.step, during_forward=True)
    shared = {b.block_id: b.ref_count for b in during.blocks if b.ref_count > 1}
    print(f"step {record.step}: {len(record.scheduler_output.scheduled)} beam requests, "
          f"{record.scheduler_output.num_prefix_cache_hit_tokens:2} prefix-hit tokens, "
          f"blocks held by several beams (block: ref_count) {shared}")

# %% [markdown]
# The block map of the last step, drawn during its forward pass: the `×N` cells are blocks
# `N` beams hold at once (after the step they are all *cached*: `BlockMap(history, 7)`).

# %%
BlockMap(history, step=7, during_forward=True)

# %% [markdown]
# ## Exercises
#
# 1. Find the temperature at which the most likely token after Romeo's `I` has a
#    probability of one half (`(logits / T).softmax(-1).max()`).
# 2. Draw the number of tokens `min_p=0.1` keeps at each of the 40 steps of the looping
#    generation above (call `next_token_logits(prompt_ids + looping.token_ids[:i])` for each
#    `i`): when is the model sure of itself?
# 3. Run the seeded request with `seed=1235` instead: how many of its first 24 tokens agree
#    with the `seed=1234` run?
# 4. Rerun the beam search with `length_penalty=0.0` and `2.0`: which beam wins each time,
#    and why does a larger penalty favour the longer beams?
