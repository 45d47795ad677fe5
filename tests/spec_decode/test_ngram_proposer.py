"""NgramProposer against a brute-force statement of prompt lookup (longest suffix of
min..max tokens seen before, earliest occurrence, the k tokens after it)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.config import SpeculativeConfig
from workbench.request import Request
from workbench.spec_decode.ngram_proposer import NgramProposer, propose_ngram


def brute_force(t, lo, hi, k):
    for n in range(hi, lo - 1, -1):
        if n > len(t) - 1:
            continue
        suffix = t[len(t) - n :]
        for i in range(len(t) - n):  # occurrences ending before the last token
            if t[i : i + n] == suffix:
                return t[i + n : i + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(t=st.lists(st.integers(0, 3), min_size=1, max_size=40), lo=st.integers(1, 4),
       extra=st.integers(0, 3), k=st.integers(1, 6))
def test_matches_the_brute_force_rule(t, lo, extra, k):
    assert propose_ngram(t, lo, lo + extra, k) == brute_force(t, lo, lo + extra, k)


def test_hand_worked_lookups():
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 2, 3, 3) == [4, 5, 1]  # "1 2 3" seen at 0
    assert propose_ngram([1, 2, 3, 1, 2, 3, 9, 1, 2, 3], 1, 3, 4) == [1, 2, 3, 9]  # earliest
    assert propose_ngram([7, 8, 9], 1, 2, 3) == []  # nothing repeats
    assert propose_ngram([5], 1, 2, 3) == []


def test_proposer_drafts_over_prompt_and_output():
    proposer = NgramProposer(SpeculativeConfig("ngram", 2, prompt_lookup_max=2, prompt_lookup_min=1))
    a = Request("a", [1, 2, 3, 4], output_token_ids=[1, 2])  # "1 2" seen in the prompt
    b = Request("b", [6, 7], output_token_ids=[8])
    assert proposer.propose([a, b]) == {"a": [3, 4]}
