"""A constraint's grammar key (vLLM's structured-output key, with its backend).

A key is the constraint as text (a JSON schema dumped in its own key order, which is the
order of the properties in the output, as vLLM's key; the regex, the
choices as the EBNF ``root ::= "a" | "b"``, the grammar, the structural tag's JSON) with the
options that change its grammar and the backend that compiles it: equal keys compile to the
same grammar, which the manager caches. ``json_object`` is the schema ``{"type": "object"}``.
:func:`~workbench.structured_output.backends.grammar_key` makes one.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from workbench.sampling_params import StructuredOutputsParams

_COMMENT = re.compile(r"(#|//).*$")


class GrammarKey(NamedTuple):
    backend: str  # "xgrammar" or "guidance"
    kind: str  # StructuredOutputsParams.kind
    spec: str
    any_whitespace: bool = True
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False


def grammar_is_likely_lark(text: str) -> bool:
    """vLLM's rule: a grammar is Lark unless some line (comments ``#`` / ``//`` removed)
    holds EBNF's ``::=``."""
    return not any("::=" in _COMMENT.sub("", line) for line in text.split("\n"))


def constraint_spec(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, the constraint as text), as in the module docstring."""
    kind = params.kind
    if kind == "json":
        return kind, (params.json if isinstance(params.json, str)
                      else json.dumps(params.json))
    if kind == "json_object":
        return kind, '{"type": "object"}'
    if kind == "choice":
        return kind, "root ::= " + " | ".join(json.dumps(c) for c in params.choice)
    return kind, getattr(params, kind)
