# %% [markdown]
# # Structured outputs: a grammar in every step
#
# A request with `structured_outputs` (or the OpenAI `response_format`) carries a grammar: a
# JSON schema, a regex, a list of choices, an EBNF or Lark grammar, or a structural tag. The
# engine compiles it off the engine thread (the request waits in vLLM's `WAITING_FOR_FSM`
# state meanwhile), and at every step the grammar turns into a *token mask*: the tokens it
# forbids get a logit of minus infinity before any other sampling rule runs. This tutorial
# forces the embedded Shakespeare model, which has never seen JSON, to answer in JSON. You
# will see:
#
# - a pydantic model become a JSON schema, then a grammar, then one mask per step;
# - how many tokens each step's mask allowed, and which tokens the grammar *forced* (the mask
#   allowed exactly one), in the StepRecord and in the StepPlayer;
# - `WAITING_FOR_FSM`, the compile cache, and the wait in the RequestTimeline;
# - the other kinds of constraint, and free requests untouched by constrained neighbours;
# - what compiling and masking cost in time to first token and per output token.

# %%
import json
from typing import Literal

import pydantic

from workbench import LLMEngine, SamplingParams
from workbench.sampling_params import StructuredOutputsParams

engine = LLMEngine(block_size=8, num_kv_blocks=64)
tokenizer = engine.tokenizer


def run(requests):
    """Run {request_id: (prompt, SamplingParams)} to completion; each final output, in order."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    return {request_id: finished[request_id] for request_id in requests}

# %% [markdown]
# ## The model, free
#
# Left alone, the model writes what it learned: verse.

# %%
free = run({"free": ("ROMEO:", SamplingParams(temperature=0, max_tokens=32))})["free"]
print(free.text)

# %% [markdown]
# ## The same prompt, forced into JSON
#
# A pydantic model gives the schema (the official `openai` client's
# `chat.completions.parse(response_format=Line)` sends exactly this schema). The constraint is
# vLLM's `StructuredOutputsParams(json=schema)`; `disable_any_whitespace` leaves no room for
# the newlines this model loves between JSON tokens.

# %%
class Line(pydantic.BaseModel):
    speaker: Literal["ROMEO", "JULIET", "NURSE"]
    mood: Literal["glad", "sad"]
    lines: int = pydantic.Field(ge=0, le=20)
    aside: bool


schema = Line.model_json_schema()
line_so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
out = run({"line": ("ROMEO:", SamplingParams(temperature=0, max_tokens=80,
                                             structured_outputs=line_so))})["line"]
print(out.text, "|", out.finish_reason)
print(repr(Line.model_validate_json(out.text)))

# %% [markdown]
# The output parses as a `Line`, and the request finished with `stop`: the grammar accepted
# the end-of-sequence token once the object was complete, which ends the request.
#
# ## Step by step: what each mask allowed
#
# Each StepRecord keeps, per constrained row that sampled, how many of the 4096 tokens the
# mask allowed and, when it allowed exactly one, the token the grammar forced. Most of a JSON
# object is forced: the braces, the quotes and every key are fixed by the schema; the model
# chooses only where the schema leaves a choice (an enum value, a digit, `true` or `false`).

# %%
rows = [(r.step, r.structured_output.rows["line"], r.sampled_token_ids["line"])
        for r in engine.history if "line" in r.structured_output.rows]
for step, row, token in rows:
    mark = "forced" if row.forced_token is not None else ""
    print(f"step {step:3}  allowed {row.num_allowed:5}  {mark:6}  {tokenizer.decode([token])!r}")
forced = sum(row.forced_token is not None for _, row, _ in rows)
print(f"{forced} of {len(rows)} tokens were forced; the model chose {len(rows) - forced}")

# %% [markdown]
# The StepPlayer shows the same in its batch table: a constrained row gets a "grammar mask"
# cell, "N allowed" or **forced** with the token. Scrub the slider to walk through the object.

# %%
from workbench.viz import RequestTimeline, StepPlayer

choice_step = next(step for step, row, _ in rows if row.forced_token is None)
player = StepPlayer(engine)
player.show(choice_step)
player

# %%
print([(r["request_id"], r["grammar"]) for r in player.batch_rows])
player.show(rows[0][0])
print([(r["request_id"], r["grammar"]) for r in player.batch_rows])

# %% [markdown]
# ## WAITING_FOR_FSM and the compile cache
#
# A new constraint compiles on the structured-output manager's own thread; until it is ready
# the request sits in the waiting queue as `WAITING_FOR_FSM` and the scheduler passes over it
# (others run). Compiled grammars are cached by their constraint: a request with a constraint
# seen before is `WAITING` at once.

# %%
verdict = StructuredOutputsParams(regex=r"(Ay|Nay), my lord[.!]")
engine.add_request("verdict", "JULIET:", SamplingParams(temperature=0, max_tokens=16,
                                                        structured_outputs=verdict))
engine.add_request("line-again", "JULIET:", SamplingParams(temperature=0, max_tokens=80,
                                                           structured_outputs=line_so))
for request_id in ("verdict", "line-again"):
    print(request_id, engine.scheduler.requests[request_id].status.name)
outs = run({})
print(engine.scheduler.structured_output_manager)

# %% [markdown]
# The timeline draws the wait as a hatched bar (when the compile outlasted a step) and names
# the compile time when you pick the request; the time is the machine's, so this cell's
# output is not checked.

# %%
# NBVAL_IGNORE_OUTPUT
timeline = RequestTimeline(engine)
timeline.select_request("verdict")
compiled = {rid: f"{s * 1000:.1f} ms" for r in engine.history
            for rid, s in r.structured_output.compiled.items()}
print(compiled)
timeline

# %% [markdown]
# ## Every kind of constraint, in one batch with a free request
#
# Regex, choice, an EBNF grammar, the same grammar in Lark (vLLM's rule: a grammar with no
# `::=` is Lark) and a structural tag in xgrammar's format (here a `<verdict>` tag around a
# regex; its elements may also be JSON schemas, grammars or free text; vLLM's older form, `{"structures": [{"begin", "schema", "end"}],
# "triggers": [...]}`, leaves free text until the model writes a trigger). The mask touches
# only the constrained rows: the free request's tokens are those it gets alone.

# %%
tag = json.dumps({"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "<verdict>"},
    {"type": "regex", "pattern": "(Ay|Nay), my (lord|lady)"},
    {"type": "const_string", "value": "</verdict>"}]}})
kinds = {
    "regex": StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
    "choice": StructuredOutputsParams(choice=["to be", "not to be"]),
    "ebnf": StructuredOutputsParams(grammar='root ::= "O " name "!"\nname ::= "Romeo" | "Juliet"'),
    "lark": StructuredOutputsParams(grammar='start: "O " name "!"\nname: "Romeo" | "Juliet"'),
    "tag": StructuredOutputsParams(structural_tag=tag),
}
alone = run({"free-alone": ("JULIET:", SamplingParams(temperature=0, max_tokens=16))})
batch = {"free": ("JULIET:", SamplingParams(temperature=0, max_tokens=16))}
batch.update({name: ("ROMEO:", SamplingParams(temperature=0, max_tokens=60, structured_outputs=so))
              for name, so in kinds.items()})
outs = run(batch)
for name, o in outs.items():
    print(f"{name:7} {o.finish_reason:6} {o.text!r}")
print("free tokens unchanged by its neighbours:",
      outs["free"].token_ids == alone["free-alone"].token_ids)

# %% [markdown]
# ## What it costs
#
# A grammar costs twice. Once when it compiles (the first request of a new constraint waits
# for it, so it lands in that request's time to first token), and at every step, when the
# engine thread fills each constrained row's mask and advances its matcher on the sampled
# token (per output token). The benchmark behind `workbench bench throughput
# --structured-outputs json-unique` runs the same requests free and constrained, alternately
# on one engine, each request with a schema of its own; the figures are this machine's (the
# median of three alternated runs, one thread: a busy machine still moves them).

# %%
# NBVAL_IGNORE_OUTPUT
from workbench.benchmarks.datasets import sample_requests
from workbench.benchmarks.structured import format_table, run_compare

spec = {"model": None, "load_format": "auto", "dtype": "auto", "device": "cpu", "threads": 1,
        "engine_kwargs": {}}
requests = sample_requests(8, (16, 32), (32, 48), engine.model_config.vocab_size,
                           set(tokenizer.all_special_ids), seed=0)
print(format_table(run_compare(spec, requests, "json-unique", repeats=3)))

# %% [markdown]
# The compile column is per grammar (a few milliseconds for a small schema once xgrammar and
# the vocabulary scan are warm; the first grammar of an engine also pays those); "mask/step"
# is the engine thread's time on grammars in a step that had constrained rows. vLLM overlaps
# the mask with the forward pass on a GPU; here both run on the same CPU one after the other,
# so the mask adds straight to the time per output token.
#
# ## Exercises
#
# 1. Make the schema bigger (nested objects, arrays with `minItems`): how do the compile time
#    and the share of forced tokens change?
# 2. Sample with `temperature=1.0` and a seed: does the output still parse? Which tokens are
#    still forced?
# 3. Build an engine with `EngineArgs(structured_outputs_config={"backend": "guidance"})` and
#    compare llguidance's masks (`num_allowed`) with xgrammar's for the same regex.
# 4. Give a JSON schema `"multipleOf": 7`: which backend does "auto" pick, and why
#    (`workbench.structured_output.backends.grammar_key`)?
# 5. Set `max_tokens` too small for the object: what finish reason and text come back?
