"""The guidance backend (llguidance, vLLM's second): a :class:`~workbench.structured_output.
request.GrammarKey` -> llguidance's serialized grammar -> a matcher per request with the same
interface as xgrammar's (bitmask, accept, validate drafts, roll back).

JSON schemas take ``whitespace_flexible`` from ``any_whitespace`` and honour a
``whitespace_pattern``; ``disable_additional_properties`` adds ``additionalProperties:
false`` wherever a schema lists properties without saying (vLLM's rule). Structural tags are
vLLM's ``structures`` / ``triggers`` form (each begin must start with a trigger). EBNF and
Lark grammars are both llguidance's own syntax. llguidance compiles lazily: "compiling" here
builds one matcher (the grammar's parse and lexer), which each request's matcher copies.
"""

from __future__ import annotations

import copy
import json
from typing import TYPE_CHECKING, Any

from workbench.structured_output.request import GrammarKey

if TYPE_CHECKING:
    import llguidance
    import torch

_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions")
_SUB_KEYWORDS = ("additionalProperties", "items", "prefixItems", "allOf", "anyOf", "oneOf",
                 "not", "if", "then", "else", "contains")


def _close_objects(schema: Any) -> None:
    """Set ``additionalProperties: false`` in place on every (sub)schema that lists
    properties and does not say."""
    if isinstance(schema, list):
        for item in schema:
            _close_objects(item)
        return
    if not isinstance(schema, dict):
        return
    for name in _MAP_KEYWORDS:
        if isinstance(schema.get(name), dict):
            for sub in schema[name].values():
                _close_objects(sub)
    for name in _SUB_KEYWORDS:
        if isinstance(schema.get(name), (dict, list)):
            _close_objects(schema[name])
    if "additionalProperties" not in schema and isinstance(schema.get("properties"), dict):
        schema["additionalProperties"] = False


def _json_grammar(schema: Any, key: GrammarKey) -> str:
    import llguidance

    if isinstance(schema, str):
        schema = json.loads(schema)
    if key.disable_additional_properties:
        schema = copy.deepcopy(schema)
        _close_objects(schema)
    defaults: dict[str, Any] = {"whitespace_flexible": key.any_whitespace}
    if key.whitespace_pattern is not None:
        defaults["whitespace_pattern"] = key.whitespace_pattern
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)


def serialize(key: GrammarKey) -> str:
    """llguidance's grammar of ``key`` (ValueError / KeyError / TypeError when malformed)."""
    import llguidance

    if key.kind in ("json", "json_object"):
        return _json_grammar(key.spec, key)
    if key.kind == "regex":
        return llguidance.grammar_from("regex", key.spec)
    if key.kind == "structural_tag":
        tag = json.loads(key.spec)
        if not isinstance(tag, dict) or "structures" not in tag:
            raise ValueError("the guidance backend reads vLLM's structural tags with "
                             "'structures' and 'triggers'; xgrammar's 'format' form needs the "
                             "xgrammar backend.")
        triggers, tags = tag["triggers"], []
        for s in tag["structures"]:
            trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
            if trigger is None:
                raise ValueError(f"Trigger {s['begin']} not found in triggers {triggers}")
            tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"],
                                             grammar=_json_grammar(s["schema"], key),
                                             end=s["end"]))
        if not tags:
            raise ValueError("No structural tags found in the grammar spec.")
        return llguidance.StructTag.to_grammar(tags)
    return llguidance.grammar_from("grammar", key.spec)  # EBNF (choices too) or Lark


def _one_line(message: str) -> str:
    """llguidance's multi-line message on one line (its source excerpt squeezed)."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())[:400]


def validate(key: GrammarKey) -> None:
    """Parse the constraint as llguidance does (no tokenizer); ValueError with its message."""
    import llguidance

    try:
        grammars = [serialize(key)]
        if key.kind == "structural_tag":  # its nested schemas are checked only when compiled
            grammars += [_json_grammar(s["schema"], key)
                         for s in json.loads(key.spec)["structures"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"Invalid grammar specification: {exc}") from None
    for grammar in grammars:
        error = llguidance.LLMatcher.validate_grammar(grammar, None)
        if error:
            raise ValueError(f"Grammar error: {_one_line(error)}")


class GuidanceBackend:
    """Compiles grammars against one tokenizer (``vocab_size``: the logits' width) and makes
    matchers. ``compile`` is thread-safe (each call builds its own matcher)."""

    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance.hf

        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile(self, key: GrammarKey) -> llguidance.LLMatcher:
        import llguidance

        try:
            grammar = serialize(key)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"Invalid grammar specification: {exc}") from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"Grammar error: {_one_line(matcher.get_error())}")
        return matcher

    def make_grammar(self, compiled: llguidance.LLMatcher) -> GuidanceGrammar:
        return GuidanceGrammar(compiled.deep_copy(), self.ll_tokenizer.eos_token)


class GuidanceGrammar:
    """One request's llguidance matcher, with XgrammarGrammar's interface and invariant.
    Terminated once it has accepted the end-of-sequence token (its mask allows only that
    token once the grammar is complete and can go no further)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token: int) -> None:
        self.matcher, self.eos_token = matcher, eos_token
        self._terminated = False
        self._eos_lag = 0  # 1: the end token was accepted by a stopped matcher, which keeps no record

    def accept_token(self, token_id: int) -> bool:
        if token_id == self.eos_token and self.matcher.is_stopped():
            self._terminated, self._eos_lag = True, 1
            return True
        ok = self.matcher.consume_token(token_id)
        if ok and token_id == self.eos_token:
            self._terminated = True
        return ok

    def validate_tokens(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts in turn; the matcher is unchanged."""
        return self.matcher.validate_tokens(tokens) if tokens and not self._terminated else 0

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            if num_tokens > self._eos_lag:
                self.matcher.rollback(num_tokens - self._eos_lag)
            self._terminated, self._eos_lag = False, 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return self._terminated
