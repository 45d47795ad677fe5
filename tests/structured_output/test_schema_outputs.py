"""Hypothesis draws JSON schemas (objects, arrays, enums, nesting, required and optional
properties, string lengths and patterns, integer bounds) and regexes; every output of the
embedded model under them validates with ``jsonschema`` / ``re.fullmatch``, greedy and
sampled, in batches beside a free request whose tokens stay those it gets alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from schema_support import json_schemas, regexes

from workbench import LLMEngine, SamplingParams
from workbench.sampling_params import StructuredOutputsParams as S

FREE = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
schemas = json_schemas(["a", "b", "c", "speaker"], integers=((-50, 50), (0, 200)), max_length=6,
                       max_leaves=4)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(device="cpu", block_size=8, num_kv_blocks=128)


@pytest.fixture(scope="module")
def free_alone(engine):
    engine.add_request("free", "JULIET:", FREE)
    return run(engine)["free"].token_ids


def run(engine):
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0] for o in engine.step()})
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return outs


def batch(engine, so: S, max_tokens: int):
    engine.add_request("free", "JULIET:", FREE)
    engine.add_request("greedy", "ROMEO:", SamplingParams(
        temperature=0, max_tokens=max_tokens, structured_outputs=so))
    engine.add_request("sampled", "ROMEO:", SamplingParams(
        temperature=1.0, seed=11, max_tokens=max_tokens, structured_outputs=so))
    return run(engine)


SETTINGS = settings(max_examples=8, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(schema=schemas)
def test_outputs_validate_against_drawn_schemas(engine, free_alone, schema):
    outs = batch(engine, S(json=schema, disable_any_whitespace=True), max_tokens=256)
    assert outs["free"].token_ids == free_alone
    for name in ("greedy", "sampled"):
        assert outs[name].finish_reason == "stop", (schema, outs[name].text)
        jsonschema.validate(json.loads(outs[name].text), schema)


@SETTINGS
@given(regex=regexes)
def test_outputs_fullmatch_drawn_regexes(engine, free_alone, regex):
    outs = batch(engine, S(regex=regex), max_tokens=64)
    assert outs["free"].token_ids == free_alone
    for name in ("greedy", "sampled"):
        assert outs[name].finish_reason == "stop", (regex, outs[name].text)
        assert re.fullmatch(regex, outs[name].text), (regex, outs[name].text)
