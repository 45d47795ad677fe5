"""Reading a JSON text that is still being generated: where each value starts and, once it
is complete, where it ends. The tool parsers stream a call's ``arguments`` as the raw text
of its value, so the fragments they send always join into the value the model wrote.

Invariant: on a longer prefix of the same text, every span found on the shorter one is
found again with the same start, and an end once found never moves.
"""

from __future__ import annotations

import json

_WS = " \t\n\r"
_CLOSE = {"{": "}", "[": "]"}


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """The index just past the JSON value starting at ``text[i]``; None while the text ends
    before the value does (a number or literal at the very end may still grow: None too)."""
    if i >= len(text):
        return None
    first = text[i]
    if first == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
            elif text[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if first in _CLOSE:
        stack, j, in_string = [_CLOSE[first]], i + 1, False
        while j < len(text):
            c = text[j]
            if in_string:
                if c == "\\":
                    j += 1
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in _CLOSE:
                stack.append(_CLOSE[c])
            elif c in "}]":
                stack.pop()
                if not stack:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in _WS + ",}]":
        j += 1
    return j if j < len(text) else None


def object_members(text: str, i: int) -> list[tuple[str, int, int | None]]:
    """The members of the JSON object starting at ``text[i]`` (``{``) as far as the text
    goes: ``(key, value start, value end or None)``; a member whose key is not complete yet,
    or whose value has not started, is left out."""
    members: list[tuple[str, int, int | None]] = []
    if i >= len(text) or text[i] != "{":
        return members
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text) or text[j] != '"':
            return members
        key_end = value_end(text, j)
        if key_end is None:
            return members
        key = _string(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text) or text[j] != ":":
            return members
        start = skip_ws(text, j + 1)
        if start >= len(text):
            return members
        end = value_end(text, start)
        members.append((key, start, end))
        if end is None:
            return members
        j = skip_ws(text, end)
        if j >= len(text) or text[j] != ",":
            return members
        j += 1


def array_items(text: str, i: int) -> list[tuple[int, int | None]]:
    """The items of the JSON array starting at ``text[i]`` (``[``) as far as the text goes:
    ``(start, end or None)``."""
    items: list[tuple[int, int | None]] = []
    if i >= len(text) or text[i] != "[":
        return items
    j = i + 1
    while True:
        start = skip_ws(text, j)
        if start >= len(text) or text[start] == "]":
            return items
        end = value_end(text, start)
        items.append((start, end))
        if end is None:
            return items
        j = skip_ws(text, end)
        if j >= len(text) or text[j] != ",":
            return items
        j += 1


def _string(literal: str) -> str:
    try:
        return json.loads(literal)
    except ValueError:
        return literal[1:-1]


def complete_string(text: str, span: tuple[int, int | None]) -> str | None:
    """The string a complete JSON string value spans (None while incomplete or not a string)."""
    start, end = span
    if end is None or text[start] != '"':
        return None
    return _string(text[start:end])
