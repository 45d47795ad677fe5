"""The strings of logprob tokens (``Logprob.decoded_token``), as vLLM's output side makes them.

Each token of a logprobs position (the sampled or prompt token, then the top-k) is decoded
alone, non-incrementally, with two corrections vLLM makes
(``vllm/tokenizers/detokenizer_utils.py: convert_ids_list_to_tokens`` and
``vllm/v1/engine/logprobs.py: LogprobsProcessor._verify_tokens``):

* **SentencePiece leading spaces.** A Metaspace tokenizer (Llama-2, Mistral: pieces such as
  ``▁true``) drops the space of the first token it decodes, so ``▁true`` and ``true`` would
  both read ``"true"`` and collide as keys of the OpenAI ``top_logprobs`` dict. The raw piece
  says how many leading spaces it carries (its leading replacement characters, ``▁``); the
  ones ``decode`` dropped are put back. Only tokenizers whose pre-tokenizer is ``Metaspace``
  (alone or in a ``Sequence``) are corrected, as in vLLM; byte-level ones (``Ġ``) keep their
  space already.
* **Bytes of a multi-byte character.** A token that is one byte of a character split over
  several tokens (byte-fallback ``<0xE4>``, a byte-level piece of an emoji) decodes alone to
  a string ending in U+FFFD. Such a string is replaced, token by token (each top-k candidate
  on its own: they are alternatives at one position, not a sequence), by what the token adds
  after the *sampled* tokens before its position: the last 1, then 2, ... up to 4 of them
  (a UTF-8 character has at most 4 bytes) are decoded with it until the text no longer ends
  in U+FFFD; the text of the clean context before the character's first byte is cut off,
  so the token that completes the character carries all of it. A byte no context completes
  gives ``""``. The context of sampled logprobs is the request's earlier sampled tokens, that
  of prompt logprobs the earlier prompt tokens that have logprobs (position 0 has none).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
#: Bytes of one UTF-8 character at most: the context a split character can need.
_MAX_CONTEXT = 4


def _leading_space_marker(tokenizer: Any) -> str | None:
    """The replacement character of a Metaspace pre-tokenizer (``▁``), else None."""
    pre = getattr(tokenizer, "pre_tokenizer", None)
    if pre is None:
        return None
    try:
        config = json.loads(pre.__getstate__())
    except Exception:  # noqa: BLE001 - an unreadable pre-tokenizer: no correction
        return None
    candidates = config.get("pretokenizers", []) if config.get("type") == "Sequence" else [config]
    for sub in candidates:
        if isinstance(sub, dict) and sub.get("type") == "Metaspace":
            return sub.get("replacement", "\u2581")
    return None


class LogprobTokenDecoder:
    """Decodes the tokens of logprobs positions for one tokenizer (a ``tokenizers.Tokenizer``
    or a transformers fast tokenizer wrapping one); see the module docstring."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._marker = _leading_space_marker(self._tokenizer)
        self._alone: dict[int, str] = {}  # token id -> decoded alone (a vocabulary at most)

    def decode(self, token_ids: Sequence[int]) -> str:
        if len(token_ids) == 1:
            token_id = token_ids[0]
            text = self._alone.get(token_id)
            if text is None:
                text = self._alone[token_id] = self._tokenizer.decode(
                    [token_id], skip_special_tokens=False)
            return text
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def token_string(self, token_id: int) -> str:
        """One token decoded alone, its SentencePiece leading spaces restored."""
        text = self.decode([token_id])
        if self._marker is None:
            return text
        piece = self._tokenizer.id_to_token(token_id) or ""
        markers = len(piece) - len(piece.lstrip(self._marker))
        missing = markers - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def position_strings(self, token_ids: Sequence[int], context: Sequence[int]) -> list[str]:
        """The strings of one position's tokens; ``context``: the sampled (or prompt) tokens
        of the positions before it, oldest first (only the last 4 are read)."""
        context = list(context[-_MAX_CONTEXT:])
        out = []
        for token_id in token_ids:
            text = self.token_string(token_id)
            if text.endswith(_REPLACEMENT):
                text = self._completed(token_id, context)
            out.append(text)
        return out

    def _completed(self, token_id: int, context: list[int]) -> str:
        """What ``token_id`` adds after the shortest tail of ``context`` that completes its
        character; "" when none does."""
        for n in range(1, len(context) + 1):
            tail = context[-n:]
            full = self.decode(tail + [token_id])
            if full.endswith(_REPLACEMENT):
                continue
            # The tail's own trailing bytes of the character belong to this token's text.
            clean = len(tail)
            while clean > 0 and self.decode([tail[clean - 1]]).endswith(_REPLACEMENT):
                clean -= 1
            prefix = self.decode(tail[:clean]) if clean else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0  # a decoder that rewrote the prefix: cut what the two share
            for a, b in zip(prefix, full):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""
