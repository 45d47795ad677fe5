"""Hypothesis strategies shared by the structured-output tests (tests/structured_output/):
JSON schemas, objects and arrays nesting integer, number, enum, boolean and string leaves,
and regexes."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

Ranges = tuple[tuple[int, int], tuple[int, int]]  # the minimum's range, the span's (inclusive)


def json_schemas(names: Sequence[str], *, integers: Ranges, numbers: Ranges | None = None,
                 max_length: int, max_leaves: int, closed: bool = False):
    """Object schemas whose properties are drawn from ``names``, each object requiring a
    drawn subset of its properties. Leaves: integers (``minimum`` in ``integers[0]``, ``maximum`` that
    plus a span in ``integers[1]``), numbers the same from ``numbers`` (None: no number
    leaf), enums, booleans, strings of at most ``max_length`` or matching a pattern. Objects
    and arrays of 0-3 items nest them, up to ``max_leaves`` leaves; ``closed``: every object
    sets ``additionalProperties: false``."""

    def bounded(kind: str, ranges: Ranges):
        (low, high), (shortest, longest) = ranges
        return st.builds(lambda lo, span: {"type": kind, "minimum": lo, "maximum": lo + span},
                         st.integers(low, high), st.integers(shortest, longest))

    numeric = [bounded("integer", integers)] + ([bounded("number", numbers)] if numbers else [])
    leaf = st.one_of(
        *numeric,
        st.lists(st.sampled_from(["ay", "nay", "O Romeo", "x"]), min_size=1, max_size=3,
                 unique=True).map(lambda v: {"enum": v}),
        st.just({"type": "boolean"}),
        st.integers(0, max_length).map(lambda n: {"type": "string", "maxLength": n}),
        st.sampled_from(["^[a-z]{1,4}$", "^[0-9]{2}$", "^(ay|nay)$"]).map(
            lambda p: {"type": "string", "pattern": p}),
    )
    extra = {"additionalProperties": False} if closed else {}

    def objects(children):
        return st.dictionaries(st.sampled_from(names), children, min_size=1, max_size=3).flatmap(
            lambda props: st.sets(st.sampled_from(sorted(props))).map(
                lambda req: {"type": "object", "properties": props, "required": sorted(req),
                             **extra}))

    def arrays(children):
        return st.builds(lambda item, lo, more: {"type": "array", "items": item, "minItems": lo,
                                                 "maxItems": lo + more},
                         children, st.integers(0, 1), st.integers(0, 2))

    return objects(st.recursive(leaf, lambda c: st.one_of(objects(c), arrays(c)),
                                max_leaves=max_leaves))


_atoms = st.sampled_from(["a", "O", " ", "[a-z]", "[0-9]", "(ay|nay)", "(Romeo|Juliet)"])
_quantifiers = st.sampled_from(["", "?", "{1,3}", "{2}"])
#: 1-4 atoms (literals, classes, alternations), each with an optional quantifier.
regexes = st.lists(st.tuples(_atoms, _quantifiers).map("".join), min_size=1, max_size=4).map(
    "".join)
