"""NgramProposer: vLLM's prompt lookup decoding, drafts copied from the request's own tokens.

For each request, over its prompt and output tokens ``t``: take the longest suffix of ``n``
tokens, ``prompt_lookup_min <= n <= prompt_lookup_max``, that also occurs earlier in ``t``
(its earliest occurrence), and propose the up to ``k`` tokens that followed that occurrence.
No match, no drafts. Deterministic and model-free: the drafts have no distribution ``q``
(the rejection sampler treats them as one-hot proposals). Costs one C-speed scan of ``t`` for
the earlier positions of the last token, then at most ``prompt_lookup_max`` comparisons per
such position.
"""

from __future__ import annotations

from collections.abc import Iterable

from workbench.config import SpeculativeConfig
from workbench.request import Request


def propose_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The up to ``k`` tokens after the earliest earlier occurrence of the longest suffix of
    ``tokens`` of ``min_n..max_n`` tokens ([] when none occurs).

    One pass over the earlier positions ``e`` holding the last token (``list.index`` finds
    each in C): the suffix's match length ending at ``e``, counted backwards up to ``max_n``;
    the first ``e`` with the longest match wins (a match of ``n`` tokens is one of every
    shorter length too, so this is the longest-``n``-first rule), and a full ``max_n`` match
    ends the search."""
    length = len(tokens)
    n_max = min(max_n, length - 1)
    last = tokens[-1] if length else None
    best, best_end, e = min_n - 1, -1, -1
    while best < n_max:
        try:
            e = tokens.index(last, e + 1, length - 1)
        except ValueError:
            break
        n = 1
        while n < n_max and n <= e and tokens[e - n] == tokens[length - 1 - n]:
            n += 1
        if n > best:
            best, best_end = n, e
    return list(tokens[best_end + 1:best_end + 1 + k]) if best_end >= 0 else []


class NgramProposer:
    """Drafts by prompt lookup (see module docstring) for the requests given."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, requests: Iterable[Request]) -> dict[str, list[int]]:
        """Request id -> its drafts (only requests with a match)."""
        out = {}
        for r in requests:
            drafts = propose_ngram(r.all_token_ids, self.min_n, self.max_n, self.k)
            if drafts:
                out[r.request_id] = drafts
        return out

    def remove(self, request_ids: Iterable[str]) -> None:
        """Nothing is kept per request."""

    def fork_shared(self) -> list:
        """Nothing heavy: a fork copies it whole."""
        return []

    def __repr__(self) -> str:
        return f"NgramProposer(k={self.k}, prompt_lookup_min={self.min_n}, prompt_lookup_max={self.max_n})"
