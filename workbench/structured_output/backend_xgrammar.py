"""The xgrammar backend (vLLM's default): a :class:`~workbench.structured_output.request.
GrammarKey` -> a compiled grammar -> a matcher that yields each step's token bitmask, advances
on the accepted tokens, validates draft tokens and rolls back.

A grammar is Lark when no line holds ``::=`` (vLLM's rule; xgrammar converts it), else EBNF.
A structural tag is xgrammar's JSON format, or vLLM's older ``structures`` / ``triggers``
form. JSON schemas with features xgrammar does not enforce (vLLM's list: ``multipleOf``,
``uniqueItems`` / ``contains``, unknown string formats, a pattern or format with length
bounds) are refused, so "auto" hands them to guidance.
Compiler errors are ValueErrors carrying xgrammar's message without its source location.
xgrammar is imported on first use (about a second): engines without constraints never load it.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from workbench.structured_output.request import GrammarKey, grammar_is_likely_lark

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

_LOCATION = re.compile(r"^\[[^\]]*\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " prefix
_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname",
            "uuid", "uri", "uri-reference", "uri-template", "json-pointer",
            "relative-json-pointer"}


def compiler_message(exc: Exception) -> str:
    """xgrammar's message, first line, without its source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _LOCATION.sub("", text)


def has_xgrammar_unsupported_json_features(schema: Any) -> bool:
    """Whether a (sub)schema uses a keyword xgrammar would silently not enforce."""
    if isinstance(schema, list):
        return any(has_xgrammar_unsupported_json_features(s) for s in schema)
    if not isinstance(schema, dict):
        return False
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(types or ())
    if types & {"integer", "number"} and "multipleOf" in schema:
        return True
    if "array" in types and {"uniqueItems", "contains", "minContains", "maxContains"} & set(
            schema):
        return True
    if "string" in types:
        if "format" in schema and schema["format"] not in _FORMATS:
            return True
        if {"pattern", "format"} & set(schema) and {"minLength", "maxLength"} & set(schema):
            return True
    return any(has_xgrammar_unsupported_json_features(v) for v in schema.values()
               if isinstance(v, (dict, list)))


def _legacy_structural_tag(spec: str):
    """vLLM's older structural tag: (StructuralTagItems, triggers), or None for the new form."""
    import xgrammar as xgr

    tag = json.loads(spec)
    if not isinstance(tag, dict) or "structures" not in tag:
        return None
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                   end=s["end"]) for s in tag["structures"]]
    return items, tag["triggers"]


def validate(key: GrammarKey) -> None:
    """Parse the constraint as xgrammar does before compiling (no tokenizer work); ValueError
    with the parser's message when xgrammar refuses it."""
    import xgrammar as xgr

    try:
        if key.kind in ("json", "json_object"):
            if has_xgrammar_unsupported_json_features(json.loads(key.spec)):
                raise ValueError("The provided JSON schema contains features not supported "
                                 "by xgrammar.")
            xgr.Grammar.from_json_schema(key.spec, any_whitespace=key.any_whitespace)
        elif key.kind == "regex":
            xgr.Grammar.from_regex(key.spec)
        elif key.kind == "structural_tag":
            legacy = _legacy_structural_tag(key.spec)
            if legacy is None:
                xgr.Grammar.from_structural_tag(key.spec)
            else:  # its schemas are parsed only when compiled: parse each here
                for item in json.loads(key.spec)["structures"]:
                    xgr.Grammar.from_json_schema(json.dumps(item["schema"]),
                                                 any_whitespace=key.any_whitespace)
                xgr.Grammar.from_structural_tag(*legacy)
        elif key.kind == "grammar" and grammar_is_likely_lark(key.spec):
            xgr.Grammar.from_lark(key.spec)
        else:
            xgr.Grammar.from_ebnf(key.spec)
    except ValueError as exc:
        raise ValueError(compiler_message(exc)) from None
    except Exception as exc:  # xgrammar raises RuntimeError / KeyError / ... with the reason
        raise ValueError(compiler_message(exc)) from None


class XgrammarBackend:
    """Compiles grammars against one tokenizer (vocabulary of ``vocab_size``, the logits'
    width) and makes matchers. ``compile`` is thread-safe (xgrammar's compiler is)."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        compiler, kind, spec = self.compiler, key.kind, key.spec
        try:
            if kind in ("json", "json_object"):
                return compiler.compile_json_schema(spec, any_whitespace=key.any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "structural_tag":
                legacy = _legacy_structural_tag(spec)
                return compiler.compile_structural_tag(*(legacy or (spec,)))
            if kind == "grammar" and grammar_is_likely_lark(spec):
                return compiler.compile_lark(spec)
            return compiler.compile_grammar(spec)
        except Exception as exc:
            raise ValueError(compiler_message(exc)) from None

    def make_grammar(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        return XgrammarGrammar(compiled)


class XgrammarGrammar:
    """One request's matcher over a compiled grammar. Invariant: it has accepted exactly the
    request's output tokens so far (preemption keeps them); ``validate_tokens`` leaves it
    as it was, ``rollback(n)`` undoes the last n accepted tokens."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)  # unbounded rollback

    def accept_token(self, token_id: int) -> bool:
        """Advance on ``token_id``; False (state unchanged) when the grammar forbids it."""
        return self.matcher.accept_token(token_id)

    def validate_tokens(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts in turn (stopping after the one
        that terminates it); the matcher is left as it was."""
        n = 0
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            n += 1
            if self.matcher.is_terminated():
                break
        if n:
            self.matcher.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected drafts)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """True once the grammar is complete and has accepted its stop token."""
        return self.matcher.is_terminated()
