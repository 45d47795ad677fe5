"""The xgrammar backend's keys and parse errors, checked against hand-written grammars and
xgrammar's own matcher."""

from __future__ import annotations

import pytest
import xgrammar as xgr

from workbench.sampling_params import StructuredOutputsParams as S
from workbench.structured_output.backend_xgrammar import validate
from workbench.structured_output.backends import grammar_key
from workbench.structured_output.request import GrammarKey, constraint_spec


def test_keys_are_the_constraint_as_text():
    assert grammar_key(S(json={"b": 1, "a": 2})) == grammar_key(S(json='{"b": 1, "a": 2}'))
    # the keys' order is the properties' order in the output: another order, another grammar
    assert grammar_key(S(json={"b": 1, "a": 2})) != grammar_key(S(json={"a": 2, "b": 1}))
    assert grammar_key(S(json_object=True)) == GrammarKey(
        "xgrammar", "json_object", '{"type": "object"}', True)
    assert grammar_key(S(regex="a+", disable_any_whitespace=True)) == GrammarKey(
        "xgrammar", "regex", "a+", False)
    key = grammar_key(S(choice=['say "hi"', "no"]))
    assert (key.kind, key.spec) == ("choice", r'root ::= "say \"hi\"" | "no"')


def test_choice_grammar_accepts_exactly_the_choices():
    spec = grammar_key(S(choice=['say "hi"', "no"])).spec
    grammar = xgr.Grammar.from_ebnf(spec)
    for text, ok in (('say "hi"', True), ("no", True), ("say hi", False), ("n", False)):
        assert xgr.testing._is_grammar_accept_string(grammar, text) is ok, text


@pytest.mark.parametrize("params, words", [
    (S(json={"type": "objectx"}), 'Unsupported type "objectx"'),
    (S(regex="a(b"), "The parenthesis is not closed"),
    (S(grammar='root ::= "a" |'), "EBNF parser error"),
])
def test_parse_errors_carry_the_compilers_message_without_its_location(params, words):
    with pytest.raises(ValueError) as info:
        validate(GrammarKey("xgrammar", *constraint_spec(params)))
    assert words in str(info.value)
    assert ".cc:" not in str(info.value)


@pytest.mark.parametrize("kwargs, words", [
    ({}, "You must use one kind of structured outputs constraint but none are specified"),
    ({"regex": "a", "json_object": True},
     "You can only use one kind of structured outputs constraint but multiple are specified"),
    ({"choice": "yes"}, "non-empty list of strings"),
    ({"json": 5}, "JSON schema"),
])
def test_params_follow_vllms_rules(kwargs, words):
    with pytest.raises(ValueError, match=words):
        S(**kwargs)
