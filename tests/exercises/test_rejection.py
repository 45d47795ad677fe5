"""Exercise 5 (rejection sampler), graded statistically: the reference (the engine's own
rejection_sample) passes; residual formulas off by one term, and an acceptance without q,
fail, with the emitted frequencies worked out by hand."""

from __future__ import annotations

import pytest
import torch

import workbench.exercises as ex
from workbench.exercises.rejection import NUM_DRAWS, Case, sample


def _accept(p, q, draft, generator, ratio):
    return torch.rand(1, generator=generator).item() < min(1.0, ratio)


def residual_is_p(p, q, draft, generator):
    """Forgets the '- q' term: resamples from the target itself."""
    if _accept(p, q, draft, generator, (p[draft] / q[draft]).item()):
        return True, draft
    return False, int(torch.multinomial(p, 1, generator=generator))


def residual_swapped(p, q, draft, generator):
    """max(0, q - p): the draft's excess instead of the target's."""
    if _accept(p, q, draft, generator, (p[draft] / q[draft]).item()):
        return True, draft
    r = (q - p).clamp_min(0)
    return False, int(torch.multinomial(r if r.sum() > 0 else p, 1, generator=generator))


def accepts_with_p(p, q, draft, generator):
    """Forgets to divide by q[draft]."""
    if _accept(p, q, draft, generator, p[draft].item()):
        return True, draft
    return False, int(torch.multinomial((p - q).clamp_min(0), 1, generator=generator))


# By hand: p = [0.5, 0.5], q = [0.8, 0.2]. The rule accepts sum(min(p, q)) = 0.7 and emits p.
# Resampling from p instead: token 0 = min(0.5, 0.8) + 0.3 * 0.5 = 0.65, token 1 = 0.35.
# Resampling from max(0, q - p) = [0.3, 0] -> token 0 always: token 0 = 0.5 + 0.3 = 0.8.
# Accepting with p[draft]: P(accept) = 0.8 * 0.5 + 0.2 * 0.5 = 0.5; the residual is token 1:
# token 0 = 0.8 * 0.5 = 0.4, token 1 = 0.6.
BY_HAND = Case((1, 1), (4, 1))


def _close(freq, expected):
    return all(abs(float(f) - e) < 5 * (e * (1 - e) / NUM_DRAWS) ** 0.5 + 1e-9 for f, e in zip(freq, expected))


@pytest.mark.parametrize("solution, freq, accept", [
    (ex.reference("rejection"), (0.5, 0.5), 0.7),
    (residual_is_p, (0.65, 0.35), 0.7),
    (residual_swapped, (0.8, 0.2), 0.7),
    (accepts_with_p, (0.4, 0.6), 0.5),
], ids=["reference", "residual_is_p", "residual_swapped", "accepts_with_p"])
def test_emitted_frequencies_match_the_hand_computation(solution, freq, accept):
    got = sample(BY_HAND, solution, 0)
    assert _close(got.freq, freq), got.freq
    assert _close([got.accept_rate], [accept]), got.accept_rate


def test_the_reference_passes():
    result = ex.check("rejection", ex.reference("rejection"), max_examples=4)
    assert result.passed and result.first_wrong_step is None, result.message


@pytest.mark.parametrize("solution, words", [
    (residual_is_p, ["token 0 came out 0.6", "p says 0.500", "Emitted frequencies, yours:     [0.6"]),
    (residual_swapped, ["came out 0.", "Emitted frequencies, yours:     [0.7"]),
    (accepts_with_p, ["Acceptance rate: yours 0.5", "the best possible sum(min(p, q)) = 0.700 ("]),
], ids=["residual_is_p", "residual_swapped", "accepts_with_p"])
def test_a_wrong_rule_fails_on_the_hand_worked_case(solution, words):
    result = ex.check("rejection", solution, workloads=[BY_HAND])
    assert not result.passed and result.first_wrong_step == 0 and result.unit == "case"
    for w in words:
        assert w in result.message, result.message
    assert "img" in result.show().value


@pytest.mark.parametrize("solution", [residual_is_p, residual_swapped, accepts_with_p])
def test_the_drawn_cases_find_each_wrong_rule(solution):
    result = ex.check("rejection", solution, max_examples=3)
    assert not result.passed and result.first_wrong_step is not None


def test_an_accepted_draft_must_be_the_token():
    result = ex.check("rejection", lambda p, q, d, g: (True, 1 - d), workloads=[BY_HAND])
    assert "accepted draft" in result.message and "an accepted draft is the token emitted" in result.message
