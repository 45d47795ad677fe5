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
from hypothesis import strategies as st

from workbench import LLMEngine, SamplingParams
from workbench.sampling_params import StructuredOutputsParams as S

FREE = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
NAMES = ["a", "b", "c", "speaker"]

leaf = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 200)),
    st.lists(st.sampled_from(["ay", "nay", "O Romeo", "x"]), min_size=1, max_size=3,
             unique=True).map(lambda v: {"enum": v}),
    st.just({"type": "boolean"}),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.sampled_from(["^[a-z]{1,4}$", "^[0-9]{2}$", "^(ay|nay)$"]).map(
        lambda p: {"type": "string", "pattern": p}),
)


def objects(children):
    return st.dictionaries(st.sampled_from(NAMES), children, min_size=1, max_size=3).flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props))).map(
            lambda req: {"type": "object", "properties": props, "required": sorted(req)}))


def arrays(children):
    return st.builds(lambda item, lo, extra: {"type": "array", "items": item, "minItems": lo,
                                              "maxItems": lo + extra},
                     children, st.integers(0, 1), st.integers(0, 2))


schemas = objects(st.recursive(leaf, lambda c: st.one_of(objects(c), arrays(c)), max_leaves=4))
atoms = st.sampled_from(["a", "O", " ", "[a-z]", "[0-9]", "(ay|nay)", "(Romeo|Juliet)"])
quantifiers = st.sampled_from(["", "?", "{1,3}", "{2}"])
regexes = st.lists(st.tuples(atoms, quantifiers).map("".join), min_size=1, max_size=4).map(
    "".join)


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
