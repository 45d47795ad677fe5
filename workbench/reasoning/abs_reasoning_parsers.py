"""vLLM's ReasoningParser interface and its registry (``ReasoningParserManager``).

``extract_reasoning`` splits a finished reply into (reasoning, content), by vLLM's rule for a
finished reply; ``extract_reasoning_streaming`` is called on every delta and
``finish_streaming`` once at the end (what the stream held back as a tag's possible
beginning); ``is_reasoning_end`` tells from token ids whether the reasoning is over
(structured outputs start there); ``extract_content_ids`` gives the ids of the content, which
chat serving hands to the tool parser. A parser is built as vLLM builds it,
``Parser(tokenizer, chat_template_kwargs=...)``: the request's template kwargs (Qwen3 reads
``enable_thinking`` there).

A stream is read through :meth:`read`, a *prefix* reading that is monotone (a longer prefix
only extends both parts), so the streamed parts join into the same reply however it was
split into deltas. ``extract_reasoning`` gives the same split except where vLLM's
finished-reply rule reads a reply differently from its own stream (each parser says where).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from workbench.utils.registry import NamedRegistry


@dataclass
class ReasoningDelta:
    """What one delta adds: to the reasoning, to the content (None: nothing)."""

    reasoning: str | None = None
    content: str | None = None


@dataclass
class ReasoningReading:
    """A prefix of the reply read so far: its reasoning and content, and where the content
    starts in the text (None while the reasoning has not ended)."""

    reasoning: str = ""
    content: str = ""
    content_at: int | None = None


class ReasoningParser:
    """Base of the reasoning parsers; one instance per choice when streaming (it keeps what
    it sent), any instance for ``extract_reasoning`` and ``is_reasoning_end``."""

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        self.model_tokenizer = tokenizer
        # vLLM passes the request's chat template kwargs by this name (None: the engine's
        # parser, which serves every request)
        self.chat_template_kwargs: dict[str, Any] = dict(kwargs.get("chat_template_kwargs")
                                                         or {})
        self._sent = (0, 0)
        self._text = ""

    def read(self, text: str, final: bool = False) -> ReasoningReading:
        """The reading of ``text``, a prefix of the reply (``final``: the whole reply, so
        nothing is held back as a tag's possible beginning)."""
        raise NotImplementedError

    def parse_prefix(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning so far, content so far) of ``text`` (see :meth:`read`)."""
        reading = self.read(text, final)
        return reading.reasoning, reading.content

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        raise NotImplementedError

    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        """vLLM's ``extract_content_ids``: the ids of the reply's content (``[]`` while the
        reasoning has not ended, or nothing follows its end). Tags are text here, split over
        several tokens: the content's ids are those of the tokens from the one that carries
        the content's first character (the token after the one that completed the end tag,
        unless that token carries content too)."""
        ids = list(input_ids)
        text = self.model_tokenizer.decode(ids)
        at = self.read(text, final=True).content_at
        if at is None or at >= len(text):
            return []
        # from the end back (chat serving asks where the content has just begun)
        k = len(ids) - 1
        while k > 0 and len(self.model_tokenizer.decode(ids[:k])) > at:
            k -= 1
        return ids[k:]

    def extract_reasoning(self, model_output: str, request: Any = None
                          ) -> tuple[str | None, str | None]:
        reading = self.read(model_output, final=True)
        return reading.reasoning or None, reading.content or None

    def extract_reasoning_streaming(
        self, previous_text: str, current_text: str, delta_text: str,
        previous_token_ids: Sequence[int] = (), current_token_ids: Sequence[int] = (),
        delta_token_ids: Sequence[int] = (),
    ) -> ReasoningDelta | None:
        self._text = current_text
        return self._send(self.read(current_text))

    def finish_streaming(self) -> ReasoningDelta | None:
        """What the stream held back (a tag's possible beginning that never became the tag):
        the rest of the whole reply's reading, once the reply has ended."""
        return self._send(self.read(self._text, final=True))

    def _send(self, reading: ReasoningReading) -> ReasoningDelta | None:
        delta = ReasoningDelta(reading.reasoning[self._sent[0]:] or None,
                               reading.content[self._sent[1]:] or None)
        self._sent = (max(self._sent[0], len(reading.reasoning)),
                      max(self._sent[1], len(reading.content)))
        return delta if delta.reasoning or delta.content else None


class ReasoningParserManager(NamedRegistry, entries="reasoning_parsers", kind="reasoning parser"):
    reasoning_parsers: ClassVar[dict[str, type[ReasoningParser]]]  # filled by register_module

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        """The parser class named ``name``; KeyError naming the known ones otherwise."""
        return cls._lookup(name)
