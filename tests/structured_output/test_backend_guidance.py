"""The guidance backend (llguidance), the "auto" fallback and the constraint kinds added after
the first part (Lark, structural tags, whitespace patterns), in the embedded model's engine.
Outputs are checked by independent means (``jsonschema``, ``re.fullmatch``, the choice list,
hand-written parses), and the two backends against each other."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from workbench import EngineArgs, LLMEngine, SamplingParams
from workbench.config import StructuredOutputsConfig
from workbench.sampling_params import StructuredOutputsParams as S
from workbench.structured_output.backends import grammar_key
from workbench.structured_output.request import grammar_is_likely_lark

OBJECT = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                 "maximum": 9},
                                           "b": {"type": "boolean"}}, "required": ["a", "b"]}
TAG = json.dumps({"type": "structural_tag", "triggers": ["<f="], "structures": [
    {"begin": "<f=x>", "schema": OBJECT, "end": "</f>"}]})
KINDS = {
    "regex": S(regex=r"[0-9]{3}-[a-z]{2,4}"),
    "choice": S(choice=["to be", "not to be"]),
    "ebnf": S(grammar='root ::= "O " name "!"\nname ::= "Romeo" | "Juliet"'),
    "lark": S(grammar='// Lark: no "::=" anywhere\nstart: "O " name "!"\n'
                      'name: "Romeo" | "Juliet"'),
    "json": S(json=OBJECT),
    "tag": S(structural_tag=TAG),
}


def run(engine, requests):
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0] for o in engine.step()})
        engine.scheduler.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return outs


def make_engine(**config):
    return LLMEngine(EngineArgs(device="cpu", block_size=8, num_kv_blocks=96,
                                structured_outputs_config=config or None))


def check(name, text):
    """The output of constraint ``name`` holds, by a parse the grammar code does not share."""
    if name == "regex":
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
    elif name == "choice":
        assert text in ("to be", "not to be"), text
    elif name in ("ebnf", "lark"):
        assert text in ("O Romeo!", "O Juliet!"), text
    elif name == "json":
        jsonschema.validate(json.loads(text), OBJECT)
    else:  # free text; each tag's body between begin and end is the schema's JSON
        for body in re.findall(r"<f=x>(.*?)</f>", text, flags=re.S):
            jsonschema.validate(json.loads(body), OBJECT)
        assert text.count("<f=x>") == text.count("</f>"), text


@pytest.fixture(scope="module")
def outputs():
    """Every kind, greedy and sampled, under each backend; with a free request beside."""
    result = {}
    for backend in ("xgrammar", "guidance"):
        requests = {"free": ("JULIET:", SamplingParams(temperature=0, max_tokens=16,
                                                       ignore_eos=True))}
        for name, so in KINDS.items():
            requests[f"{name}-greedy"] = ("ROMEO:", SamplingParams(
                temperature=0, max_tokens=32, structured_outputs=so))
            requests[f"{name}-sampled"] = ("ROMEO:", SamplingParams(
                temperature=1.0, seed=5, max_tokens=32, structured_outputs=so))
        engine = make_engine(backend=backend)
        result[backend] = (engine, run(engine, requests))
    return result


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_kind_holds_on_both_backends_greedy_and_sampled(outputs, backend, name):
    engine, outs = outputs[backend]
    for mode in ("greedy", "sampled"):
        out = outs[f"{name}-{mode}"]
        if name in ("json", "tag") and out.finish_reason == "length":
            check(name, out.text) if name == "tag" else None  # free text: complete tags hold
            continue  # JSON: the model may still be writing a number
        assert out.finish_reason == "stop", out
        check(name, out.text)
    backends = {rid: b for r in engine.history for rid, b in r.structured_output.backends.items()}
    assert backends[f"{name}-greedy"] == backend


def test_the_backends_agree_and_leave_free_requests_alone(outputs):
    alone = run(make_engine(), {"free": ("JULIET:", SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True))})["free"].token_ids
    xgr, guidance = outputs["xgrammar"][1], outputs["guidance"][1]
    assert xgr["free"].token_ids == guidance["free"].token_ids == alone
    for name in ("regex", "choice", "ebnf", "lark", "tag"):  # the same language, greedy
        assert xgr[f"{name}-greedy"].text == guidance[f"{name}-greedy"].text, name


def test_lark_is_told_from_ebnf_by_vllms_rule():
    assert grammar_is_likely_lark('start: "a" | "b"')
    assert grammar_is_likely_lark('// root ::= "a" in a comment\nstart: "a"')
    assert not grammar_is_likely_lark('root ::= "a" | "b"')
    assert grammar_key(KINDS["lark"]).backend == "xgrammar"  # xgrammar reads Lark itself


def test_whitespace_pattern_goes_to_guidance_and_holds():
    so = S(json=OBJECT, whitespace_pattern=r"[ ]{0,2}", disable_additional_properties=True)
    assert grammar_key(so).backend == "guidance"
    with pytest.raises(ValueError, match="whitespace_pattern is only supported by the guidance"):
        grammar_key(so, StructuredOutputsConfig(backend="xgrammar"))
    outs = run(make_engine(), {f"r{i}": ("ROMEO:", SamplingParams(
        temperature=1.0, seed=i, max_tokens=40, structured_outputs=so)) for i in range(2)})
    for out in outs.values():
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), OBJECT)
        assert "\n" not in out.text and "   " not in out.text, out.text


def test_auto_falls_back_to_guidance_for_what_xgrammar_cannot_enforce():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 7,
                                                     "minimum": 1, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    assert grammar_key(S(json=schema)).backend == "guidance"
    with pytest.raises(ValueError, match="features not supported by xgrammar"):
        grammar_key(S(json=schema, disable_fallback=True))
    with pytest.raises(ValueError, match="features not supported by xgrammar"):
        grammar_key(S(json=schema), StructuredOutputsConfig(disable_fallback=True))
    outs = run(make_engine(), {f"r{i}": ("ROMEO:", SamplingParams(
        temperature=1.0, seed=i, max_tokens=16, structured_outputs=S(
            json=schema, disable_any_whitespace=True))) for i in range(2)})
    for out in outs.values():
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), schema)  # jsonschema checks multipleOf


def test_disable_additional_properties_closes_guidance_objects():
    so = S(json={"type": "object", "properties": {"a": {"type": "boolean"}}},
           disable_additional_properties=True, disable_any_whitespace=True)
    closed = dict(so.json, additionalProperties=False)
    outs = run(make_engine(backend="guidance"), {f"r{i}": ("ROMEO:", SamplingParams(
        temperature=1.0, seed=i, max_tokens=24, structured_outputs=so)) for i in range(2)})
    for out in outs.values():
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), closed)


@pytest.mark.parametrize("so, config, words", [
    (S(regex="a(b"), {"backend": "guidance"}, "Grammar error: at 1(8): invalid regex"),
    (S(grammar='start: "a" ('), {"backend": "guidance"}, "Grammar error"),
    (S(json={"type": "objectx"}), {}, 'Unsupported type "objectx"'),  # both refuse: xgrammar's
    (S(structural_tag=json.dumps({"triggers": ["<f="], "structures": [
        {"begin": "<g=", "schema": {}, "end": "</g>"}]})), {"backend": "guidance"},
     "Trigger <g= not found in triggers"),
    (S(structural_tag=json.dumps({"type": "structural_tag", "format": {
        "type": "const_string", "value": "hi"}})), {"backend": "guidance"}, "'format' form"),
])
def test_bad_constraints_are_refused_before_the_engine_with_the_parsers_message(so, config,
                                                                                words):
    engine = make_engine(**config)
    with pytest.raises(ValueError, match=re.escape(f"structured_outputs: {words}")
                       if words.startswith("Grammar") else re.escape(words)):
        engine.add_request("bad", "ROMEO:", SamplingParams(structured_outputs=so))
    assert not engine.has_unfinished_requests()


def test_xgrammars_own_structural_tag_format():
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Verdict: "},
        {"type": "json_schema", "json_schema": {"enum": ["ay", "nay"]}}]}}
    outs = run(make_engine(), {"r": ("ROMEO:", SamplingParams(
        temperature=0, max_tokens=16, structured_outputs=S(structural_tag=json.dumps(tag))))})
    assert outs["r"].text in ('Verdict: "ay"', 'Verdict: "nay"'), outs["r"]
