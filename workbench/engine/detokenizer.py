"""Incremental detokenization and stop-string detection for one request.

Text is produced with ``tokenizers.decoders.DecodeStream``, which holds back tokens
until they decode to whole UTF-8 characters, so a character split across tokens
(an emoji, a CJK character) never reaches the text as U+FFFD.

Invariants:

* while no stop string matched, ``text`` equals the tokenizer's ``decode`` of the
  output tokens fed so far, except for a trailing incomplete character that the
  stream still holds (``flush()`` writes it out, as ``decode`` would, with U+FFFD);
* once a stop string matched, ``text`` ends just before it (or just after it with
  ``include_stop_str_in_output``) and never changes again;
* with ``min_tokens``, a stop string counts only when the token that completes it comes after
  the first ``min_tokens`` output tokens (vLLM checks once more than ``min_tokens`` are out);
* ``get_delta`` never returns the last ``len(longest stop) - 1`` characters of an
  unfinished request, so a partial stop string that is later cut is never streamed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from workbench.request import Request

# Prompt tokens fed to the stream before the first output token: enough context for
# decoders whose output depends on the previous token (SentencePiece's leading space).
_CONTEXT_TOKENS = 6
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, a few tokens at a time."""

    def __init__(self, tokenizer: Any, request: Request) -> None:
        # A transformers fast tokenizer wraps a ``tokenizers.Tokenizer``; accept either.
        self._tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
        params = request.sampling_params
        self._skip_special = params.skip_special_tokens
        self.stop_strings: tuple[str, ...] = params.stop_strings
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._hold_back = max((len(s) for s in self.stop_strings), default=1) - 1
        # Context: the prompt's last tokens, minus a trailing incomplete character, so the
        # output text is what ``decode`` gives for the output tokens alone.
        context = list(request.prompt_token_ids[-_CONTEXT_TOKENS:])
        while context and self._decode(context).endswith(_REPLACEMENT):
            context.pop()
        self._ids: list[int] = context  # context + every output token fed
        self._num_context = len(context)
        self._num_pending = 0  # trailing tokens of _ids the stream has not turned into text yet
        self._stream = self._new_stream(context)
        self._text = ""
        self._num_sent = 0  # characters already handed out by get_delta
        self.stop_string: str | None = None  # the stop string that ended the text, if any

    # ------------------------------------------------------------------ public
    @property
    def text(self) -> str:
        """The output text so far (truncated at the stop string once one matched)."""
        return self._text

    @property
    def num_output_tokens(self) -> int:
        """Output tokens fed through ``update`` (tokens after a stop string are not fed)."""
        return len(self._ids) - self._num_context

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append the tokens' text; return the stop string that matched, else None.

        Tokens after the one that completed a stop string are ignored, and so is every
        call after a match.
        """
        if self.stop_string is not None:
            return None
        ids, stream, tokenizer = self._ids, self._stream, self._tokenizer
        for token_id in new_token_ids:
            ids.append(token_id)
            try:
                chunk = stream.step(tokenizer, token_id)
            except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception subclass
                chunk = self._restart_stream()
                stream = self._stream
            if chunk is None:
                self._num_pending += 1
                continue
            self._num_pending = 0
            if self.stop_strings:
                if self._append(chunk):
                    return self.stop_string
            else:  # nothing to look for: the text only grows
                self._text += chunk
        return None

    def flush(self) -> str | None:
        """Write out tokens the stream still holds (an incomplete trailing character).

        Call once when the request finishes without a stop string; afterwards ``text``
        equals ``decode`` of the output tokens. Returns a stop string if the flushed
        text completed one.
        """
        if self.stop_string is not None or not self._num_pending:
            return None
        # Decode with a little context before the held tokens so decoders that depend on
        # the previous token (SentencePiece spaces) render them as in the full decode.
        start = len(self._ids) - self._num_pending
        before = self._ids[max(0, start - _CONTEXT_TOKENS) : start]
        full = self._decode(before + self._ids[start:])
        self._num_pending = 0
        self._append(full[len(self._decode(before)) :])
        return self.stop_string

    def visible_text(self, finished: bool) -> str:
        """The text so far, less the characters ``get_delta`` would still hold back."""
        if finished or self.stop_string is not None or not self._hold_back:
            return self._text
        return self._text[: max(self._num_sent, len(self._text) - self._hold_back)]

    def get_delta(self, finished: bool) -> str:
        """Text not returned by an earlier call.

        While unfinished (and no stop string matched) the last ``len(longest stop) - 1``
        characters are held back; ``finished=True`` returns everything left.
        """
        end = len(self._text)
        if not finished and self.stop_string is None:
            end = max(self._num_sent, end - self._hold_back)
        delta = self._text[self._num_sent : end]
        self._num_sent = end
        return delta

    def __repr__(self) -> str:
        return (
            f"IncrementalDetokenizer(text={self._text!r}, tokens={self.num_output_tokens}, "
            f"stop_string={self.stop_string!r})"
        )

    # ------------------------------------------------------------------ internals
    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _new_stream(self, context: list[int]) -> DecodeStream:
        """A DecodeStream that has seen ``context`` (its text is discarded)."""
        stream = DecodeStream(skip_special_tokens=self._skip_special)
        if context:
            stream.step(self._tokenizer, context)
        return stream

    def _restart_stream(self) -> str | None:
        """The text of the last token of ``_ids`` after the stream refused it.

        DecodeStream refuses to go on when a decoder rewrites text it already returned (its
        "invalid prefix" error). Restart it from the tokens before the held ones and replay
        those plus this token, as vLLM does; a second failure is a real error and propagates."""
        start = len(self._ids) - 1 - self._num_pending
        self._stream = self._new_stream(self._ids[max(0, start - _CONTEXT_TOKENS) : start])
        return self._stream.step(self._tokenizer, self._ids[start:])

    def _append(self, chunk: str) -> bool:
        """Append text and look for a stop string ending in it; True when one matched."""
        old_len = len(self._text)
        self._text += chunk
        if not self.stop_strings or self.num_output_tokens <= self._min_tokens:
            return False  # vLLM: stop strings count once more than min_tokens tokens are out
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self.stop_strings:
            # Only occurrences that end in the new text: they start at most len - 1 back.
            idx = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if idx >= 0:
                key = (idx + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        if best is None:
            return False
        end, neg_len, stop = best
        # Reading left to right, the stop completed first wins (the longest on a tie),
        # so the result does not depend on where the token boundaries fall.
        self._text = self._text[: end if self._include_stop else end + neg_len]
        self.stop_string = stop
        return True
