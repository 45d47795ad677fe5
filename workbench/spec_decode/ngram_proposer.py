"""NgramProposer: vLLM's prompt lookup decoding, drafts copied from the request's own tokens.

For each request, over its prompt and output tokens ``t``: take the longest suffix of ``n``
tokens, ``prompt_lookup_min <= n <= prompt_lookup_max``, that also occurs earlier in ``t``
(its earliest occurrence), and propose the up to ``k`` tokens that followed that occurrence.
No match, no drafts. Deterministic and model-free: the drafts have no distribution ``q``
(the rejection sampler treats them as one-hot proposals). Costs O(len(t)) to find the earlier
positions of the last token, then O(candidates * n) per suffix length.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from workbench.config import SpeculativeConfig
from workbench.request import Request


def propose_ngram(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The up to ``k`` tokens after the earliest earlier occurrence of the longest suffix of
    ``tokens`` of ``min_n..max_n`` tokens ([] when none occurs)."""
    t = np.asarray(tokens, dtype=np.int64)
    length = len(t)
    # Candidate ends: earlier positions holding the last token, each followed by a token.
    ends = np.flatnonzero(t[: length - 1] == t[length - 1])
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        cand = ends[ends >= n - 1]
        if not cand.size:
            continue
        window = cand[:, None] + np.arange(1 - n, 1)[None, :]
        hits = cand[(t[window] == t[length - n :]).all(axis=1)]
        if hits.size:
            start = int(hits[0]) + 1
            return t[start : start + k].tolist()
    return []


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
