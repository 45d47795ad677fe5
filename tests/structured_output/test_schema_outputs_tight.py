"""Hypothesis-drawn JSON schemas and regexes under a tight pool, on both backends: every
prompt longer than the step's token budget (chunked prefill), more KV than the pool holds
(preemption and recompute), constrained requests greedy and sampled beside a free one. Every
output the grammar ended validates (``jsonschema``, ``re.fullmatch``; a JSON output cut by
max_tokens, a number the model kept writing, is counted apart); the free request's tokens are
those it gets alone; the runs preempted. ``test_tally`` (last) prints how many were drawn and checked.
"""

from __future__ import annotations

import collections
import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from schema_support import json_schemas, regexes

from workbench import EngineArgs, LLMEngine, SamplingParams
from workbench.sampling_params import StructuredOutputsParams as S

PROMPT = "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?"  # 20 tokens: over the budget
FREE = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
TALLY = collections.Counter()
schemas = json_schemas(["a", "b", "speaker", "lines"], integers=((-20, 20), (0, 50)),
                       numbers=((-5, 5), (1, 10)), max_length=5, max_leaves=3, closed=True)


def tight(backend):
    """20 blocks of 4 tokens (one request's prompt and 60 outputs) and 16 tokens a step:
    prompts are chunked, and three requests outgrow the pool (preemption)."""
    return LLMEngine(EngineArgs(device="cpu", dtype="float32", block_size=4, num_kv_blocks=20,
                                max_num_batched_tokens=16, max_num_seqs=4,
                                structured_outputs_config={"backend": backend}))


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def engine(request):
    engine = tight(request.param)
    engine.add_request("free", PROMPT, FREE)
    outs = run(engine)
    engine.free_alone = outs["free"].token_ids
    return engine


def run(engine):
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0] for o in engine.step()})
        engine.scheduler.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return outs


def batch(engine, so: S, max_tokens: int):
    """The free request, and the constraint greedy and sampled: three requests whose KV
    outgrows the pool. Returns the constrained outputs; counts the run's preemptions."""
    first = engine.history[-1].step + 1
    engine.add_request("free", PROMPT, FREE)
    engine.add_request("greedy", PROMPT, SamplingParams(
        temperature=0, max_tokens=max_tokens, structured_outputs=so))
    engine.add_request("sampled", PROMPT, SamplingParams(
        temperature=1.0, seed=3, max_tokens=max_tokens, structured_outputs=so))
    outs = run(engine)
    TALLY["preemptions"] += sum(r.scheduler_stats.num_preemptions for r in engine.history
                                if r.step >= first)
    assert outs["free"].token_ids == engine.free_alone
    return {k: v for k, v in outs.items() if k != "free"}


SETTINGS = settings(max_examples=2, deadline=None, derandomize=True,
                    phases=[Phase.explicit, Phase.generate],  # a failure is shown, not shrunk
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(schema=schemas)
def test_outputs_validate_against_drawn_schemas(engine, schema):
    TALLY["schemas"] += 1
    outs = batch(engine, S(json=schema, disable_any_whitespace=True), max_tokens=60)
    for out in outs.values():
        if out.finish_reason == "length":  # a number the model kept writing: cut, counted
            TALLY["schema outputs cut by max_tokens"] += 1
            continue
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
        TALLY["schema outputs validated"] += 1


@SETTINGS
@given(regex=regexes)
def test_outputs_fullmatch_drawn_regexes(engine, regex):
    TALLY["regexes"] += 1
    outs = batch(engine, S(regex=regex), max_tokens=24)
    for out in outs.values():
        assert out.finish_reason == "stop", (regex, out.text)
        assert re.fullmatch(regex, out.text), (regex, out.text)
        TALLY["regex outputs validated"] += 1


def test_tally():
    """Runs last in this file: the counts of the tests above (both backends)."""
    if not TALLY["schemas"] or not TALLY["regexes"]:
        pytest.skip("counts the tests above: run the whole file")
    print(f"\nstructured outputs under a tight pool: {dict(TALLY)}")
    validated, cut = TALLY["schema outputs validated"], TALLY["schema outputs cut by max_tokens"]
    assert validated + cut == 2 * TALLY["schemas"] and validated > cut
    assert TALLY["regex outputs validated"] == 2 * TALLY["regexes"] > 0
    assert TALLY["preemptions"] > 0
