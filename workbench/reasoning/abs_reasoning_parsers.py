"""vLLM's ReasoningParser interface and its registry (``ReasoningParserManager``).

``extract_reasoning`` splits a finished reply into (reasoning, content);
``extract_reasoning_streaming`` is called on every delta; ``is_reasoning_end`` tells from
token ids whether the reasoning is over (structured outputs start there). A parser here
reads a *prefix* of the reply (:meth:`parse_prefix`, monotone: a longer prefix only extends
both parts), so the streamed parts join into the finished reply's, however it was split.
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


class ReasoningParser:
    """Base of the reasoning parsers; one instance per choice when streaming (it keeps what
    it sent), any instance for ``extract_reasoning`` and ``is_reasoning_end``."""

    def __init__(self, tokenizer: Any) -> None:
        self.model_tokenizer = tokenizer
        self._sent = (0, 0)

    def parse_prefix(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning so far, content so far) of ``text``, a prefix of the reply (``final``:
        the whole reply, so nothing is held back as a tag's possible beginning)."""
        raise NotImplementedError

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        raise NotImplementedError

    def extract_reasoning(self, model_output: str, request: Any = None
                          ) -> tuple[str | None, str | None]:
        reasoning, content = self.parse_prefix(model_output, final=True)
        return reasoning or None, content or None

    def extract_reasoning_streaming(
        self, previous_text: str, current_text: str, delta_text: str,
        previous_token_ids: Sequence[int] = (), current_token_ids: Sequence[int] = (),
        delta_token_ids: Sequence[int] = (),
    ) -> ReasoningDelta | None:
        reasoning, content = self.parse_prefix(current_text)
        delta = ReasoningDelta(reasoning[self._sent[0]:] or None,
                               content[self._sent[1]:] or None)
        self._sent = (len(reasoning), len(content))
        return delta if delta.reasoning or delta.content else None


class ReasoningParserManager(NamedRegistry, entries="reasoning_parsers", kind="reasoning parser"):
    reasoning_parsers: ClassVar[dict[str, type[ReasoningParser]]]  # filled by register_module

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        """The parser class named ``name``; KeyError naming the known ones otherwise."""
        return cls._lookup(name)
