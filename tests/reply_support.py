"""Feeding a reply to a ReplyReader as chat serving does: the embedded tokenizer's tokens
(which split every tag into several), grouped into deltas at given cuts, each delta with its
text and token ids, the last one flushed. Returns what the stream said, joined."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from workbench.entrypoints.openai.reply_parsing import ReplyReader


@dataclass
class Streamed:
    reasoning: str = ""
    content: str = ""
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # index: first part + args
    chunks: int = 0

    def tool_calls(self) -> list[tuple[str, str]]:
        return [(c["name"], c["arguments"]) for _, c in sorted(self.calls.items())]


def stream(reader: ReplyReader, tok, text: str, cuts=None) -> Streamed:
    """``text``'s tokens fed in deltas cut before the token indexes ``cuts`` (None: one token
    per delta)."""
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    if cuts is None:
        cuts = range(1, len(ids))
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(ids)}), len(ids)]
    out, current = Streamed(), ""
    for b in bounds[1:]:
        previous, current = current, tok.decode(ids[:b])
        delta = current[len(previous):]
        fields = reader.delta(current, delta, ids[:b]) if delta else {}
        if b == len(ids):
            fields = reader.flush(current, fields)
        out.chunks += bool(fields)
        out.reasoning += fields.get("reasoning", "")
        assert fields.get("reasoning") == fields.get("reasoning_content")
        out.content += fields.get("content", "")
        for part in fields.get("tool_calls", []):
            function = part["function"]
            if part["index"] not in out.calls:  # a call's first part: id, type and name
                assert part["id"].startswith("chatcmpl-tool-") and part["type"] == "function"
                out.calls[part["index"]] = {"name": function["name"], "arguments": "",
                                            "first": dict(function)}
            else:
                assert "id" not in part and "name" not in function
            out.calls[part["index"]]["arguments"] += function.get("arguments", "")
    return out


def finished(reader: ReplyReader, text: str) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    fields, calls = reader.message(text)
    return fields, [(c.function.name, c.function.arguments) for c in calls]


def cuts(tok, text: str):
    """Hypothesis: any set of cut points between ``text``'s tokens (for :func:`stream`)."""
    n = len(tok.encode(text, add_special_tokens=False))
    return st.lists(st.integers(1, max(1, n - 1)), max_size=n)
