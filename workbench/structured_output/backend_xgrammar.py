"""The xgrammar backend (vLLM's default): a request's constraint -> a compiled grammar -> a
matcher that yields each step's token bitmask and advances on the accepted tokens.

A grammar's key is ``(kind, spec)``, where ``spec`` is the constraint as text (a JSON schema
dumped with sorted keys, the regex, the choices as JSON, the EBNF); equal keys compile to the
same grammar, which the manager caches. Choices become the EBNF ``root ::= "a" | "b"`` (each
a JSON string literal); ``json_object`` is the schema ``{"type": "object"}``, as vLLM.
Compiler errors are ValueErrors carrying xgrammar's message without its source location.
xgrammar is imported on first use (about a second): engines without constraints never load it.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from workbench.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

GrammarKey = tuple[str, str, bool]  # (kind, spec, any_whitespace)
_LOCATION = re.compile(r"^\[[^\]]*\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " prefix


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    """The cache key of a constraint (see the module docstring)."""
    kind = params.kind
    if kind == "json":
        spec = params.json if isinstance(params.json, str) else json.dumps(params.json,
                                                                            sort_keys=True)
    elif kind == "json_object":
        spec = '{"type": "object"}'
    elif kind == "choice":
        spec = "root ::= " + " | ".join(json.dumps(c) for c in params.choice)
    else:
        spec = getattr(params, kind)
    return kind, spec, not params.disable_any_whitespace


def compiler_message(exc: Exception) -> str:
    """xgrammar's message, first line, without its source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _LOCATION.sub("", text)


def validate_grammar(params: StructuredOutputsParams) -> None:
    """Parse the constraint as xgrammar does before compiling; ValueError with the parser's
    message when it is not a valid schema, regex or grammar (cheap: no tokenizer work)."""
    import xgrammar as xgr

    kind, spec, any_whitespace = grammar_key(params)
    try:
        if kind in ("json", "json_object"):
            xgr.Grammar.from_json_schema(spec, any_whitespace=any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        else:
            xgr.Grammar.from_ebnf(spec)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the reason
        raise ValueError(compiler_message(exc)) from None


class XgrammarBackend:
    """Compiles grammars against one tokenizer (vocabulary of ``vocab_size``, the logits'
    width) and makes matchers. ``compile`` is thread-safe (xgrammar's compiler is)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        kind, spec, any_whitespace = key
        try:
            if kind in ("json", "json_object"):
                return self.compiler.compile_json_schema(spec, any_whitespace=any_whitespace)
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            return self.compiler.compile_grammar(spec)
        except Exception as exc:
            raise ValueError(compiler_message(exc)) from None


class XgrammarGrammar:
    """One request's matcher over a compiled grammar. Invariant: it has accepted exactly the
    request's output tokens so far (preemption keeps them, so it needs no rollback)."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        import xgrammar as xgr

        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)

    def replayed(self, token_ids) -> XgrammarGrammar:
        """A new matcher over the same compiled grammar that accepted ``token_ids`` (a forked
        engine's copy of this one, given the request's output tokens: the invariant)."""
        grammar = XgrammarGrammar(self.compiled)
        for token in token_ids:
            grammar.accept_token(token)
        return grammar

    def accept_token(self, token_id: int) -> bool:
        """Advance on ``token_id``; False (state unchanged) when the grammar forbids it."""
        return self.matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """True once the grammar is complete and has accepted its stop token."""
        return self.matcher.is_terminated()
