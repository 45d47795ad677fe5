"""Prompts cut from the embedded Shakespeare corpus to exact token lengths.

A prompt starts at a line start of the corpus (from its first act on) and is exactly the
requested number of tokens as the engine counts them (special tokens such as bos included):
a text prompt is kept only when re-encoding it gives back exactly the cut tokens. A prompt
may continue a given prefix (requests sharing a system prompt), on a new line.
"""

from __future__ import annotations

import bisect
import functools
import gzip
import importlib.resources
import pathlib

import numpy as np

from workbench.lab.token_ids import TokenIds

#: The corpus file (``workbench.data/shakespeare/corpus/<name>.txt.gz``) prompts are cut from.
CORPUS_WORK = "romeo_and_juliet"


class PromptCutter:
    """Cuts prompts of exact token lengths out of the corpus, from ``rng``-chosen line starts.

    ``tokenizer``: what measures the prompts (None: the embedded model's; a path: loaded
    from it); ``text=False``: prompts are token ids instead of text, as
    :class:`~workbench.lab.token_ids.TokenIds` cut from the corpus' ids (``ids``, checked
    once): its own Python ints, so a large workload holds one pointer per token, not a new int."""

    MAX_TRIES = 200

    def __init__(self, tokenizer, rng: np.random.Generator, text: bool):
        self.tokenizer = resolve_tokenizer(tokenizer)
        self.rng = rng
        self.text = text
        corpus, ids, offsets, line_starts = _corpus_tokens(self.tokenizer)
        self.corpus, self.ids, self.offsets, self.line_starts = corpus, ids, offsets, line_starts
        self.bos = TokenIds(encode(self.tokenizer, ""))  # what the tokenizer adds in front

    def prompt(self, length: int, prefix: str | tuple[int, ...] | None = None) -> str | TokenIds:
        """A prompt of exactly ``length`` tokens (as the engine counts them) that starts with
        ``prefix``'s tokens."""
        base_ids = self._encode(prefix) if prefix is not None else self.bos
        need = length - len(base_ids)
        if need < 1:
            raise ValueError(f"input_len {length} is too short: at least {len(base_ids) + 1} tokens are needed.")
        if need > len(self.ids) // 2:
            raise ValueError(f"input_len {length} exceeds what the corpus provides ({len(self.ids) // 2} tokens).")
        starts = self._num_starts(need)
        first = int(self.rng.integers(starts))
        for k in range(self.MAX_TRIES):
            i = self.line_starts[(first + k) % starts]
            if prefix is not None:  # continue the prefix on a new line: start at the newline
                i -= 1
                if i < 0 or self.corpus[self.offsets[i][0] : self.offsets[i][1]].strip():
                    continue
            piece = self.ids[i : i + need]
            if not self.text:
                return base_ids + piece
            text = (prefix or "") + self.corpus[self.offsets[i][0] : self.offsets[i + need - 1][1]]
            if self._encode(text) == base_ids + piece:
                return text
        raise ValueError(f"no text prompt of exactly {length} tokens found in {self.MAX_TRIES} tries.")

    def tokens(self, length: int) -> TokenIds:
        """``length`` corpus token ids (no bos) from an ``rng``-chosen line start."""
        if not 1 <= length <= len(self.ids) // 2:
            raise ValueError(f"a corpus piece is 1..{len(self.ids) // 2} tokens, got {length}.")
        i = self.line_starts[int(self.rng.integers(self._num_starts(length)))]
        return self.ids[i : i + length]

    def _num_starts(self, length: int) -> int:
        """How many line starts leave ``length`` tokens after them (the first so many of
        ``line_starts``, which is sorted)."""
        return bisect.bisect_left(self.line_starts, len(self.ids) - length)

    def _encode(self, prompt: str | tuple[int, ...]) -> TokenIds:
        return TokenIds(prompt if isinstance(prompt, tuple) else encode(self.tokenizer, prompt))


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str):
    """A tokenizers.Tokenizer from a tokenizer.json, or a transformers tokenizer otherwise."""
    file = pathlib.Path(path) / "tokenizer.json"
    if file.is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(file))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def resolve_tokenizer(tokenizer):
    """The tokenizer to measure prompts with: given, loaded from a path, or the embedded
    model's (read from its tokenizer.json: fast, and without importing torch)."""
    if tokenizer is None:
        tokenizer = importlib.resources.files("workbench.data") / "tiny-shakespeare"
    if isinstance(tokenizer, (str, pathlib.Path)) or hasattr(tokenizer, "joinpath"):
        return _load_tokenizer(str(tokenizer))
    return tokenizer


def encode(tokenizer, text: str) -> list[int]:
    """Token ids as the engine sees them (special tokens such as bos included)."""
    if hasattr(tokenizer, "backend_tokenizer"):  # a transformers tokenizer
        return list(tokenizer(text).input_ids)
    return list(tokenizer.encode(text).ids)


_CORPUS_CACHE: dict[int, tuple] = {}  # id(tokenizer) -> corpus data and the tokenizer (kept alive)


def _corpus_tokens(tokenizer) -> tuple[str, TokenIds, list[tuple[int, int]], list[int]]:
    """The corpus text (from its first act on), its token ids and character offsets, and the
    indices of the tokens that start a non-empty line, ascending. Cached per tokenizer."""
    key = id(tokenizer)
    if key not in _CORPUS_CACHE:
        path = importlib.resources.files("workbench.data") / "shakespeare" / "corpus" / f"{CORPUS_WORK}.txt.gz"
        with gzip.open(str(path), "rt", encoding="utf-8") as f:
            text = f.read()
        text = text[max(0, text.find("ACT I")) :]
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not hasattr(backend, "encode_batch"):
            raise ValueError("prompts need a fast (tokenizers-backed) tokenizer to cut the corpus.")
        enc = backend.encode(text, add_special_tokens=False)
        offsets = list(enc.offsets)
        starts = [
            i for i, (a, b) in enumerate(offsets) if (a == 0 or text[a - 1] == "\n") and text[a:b].strip()
        ]
        _CORPUS_CACHE[key] = (text, TokenIds(enc.ids), offsets, starts, tokenizer)
    return _CORPUS_CACHE[key][:4]
