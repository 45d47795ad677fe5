"""Exercise 5: speculative decoding's accept/resample rule, graded statistically.

The learner writes ``verify(p, q, draft, generator) -> (accepted, token)`` for one draft
position: ``p`` the target model's probabilities, ``q`` the draft model's (both 1-D tensors
over the vocabulary), ``draft`` a token drawn from ``q``. The rule (Leviathan et al. 2023; the
engine's :func:`~workbench.worker.rejection_sampler.rejection_sample`): accept with probability
``min(1, p[draft] / q[draft])``; on rejection draw from the residual ``max(0, p - q)``
normalised. Then the emitted token is distributed exactly as ``p``, and drafts are accepted at
the best possible rate, ``sum(min(p, q))``.

Randomness cannot be compared draw by draw, so the grader compares distributions: for each
hypothesis-drawn pair ``(p, q)`` (from a fixed seed; a small vocabulary, ``p`` and ``q`` apart
enough to tell rules apart) it calls ``verify`` :data:`NUM_DRAWS` times with drafts drawn from
``q`` and fails the first case where the emitted tokens' frequencies or the acceptance rate lie
more than :data:`Z_LIMIT` standard errors from ``p`` and ``sum(min(p, q))``. With that limit a
correct rule fails with probability below 1e-5 per case (and, the seed fixed, never changes
verdict between runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from hypothesis import assume
from hypothesis import strategies as st

from workbench.exercises.grader import SEED, CheckResult, Mismatch, call_solution, first_failure
from workbench.worker.rejection_sampler import rejection_sample

NUM_DRAWS = 2000
Z_LIMIT = 5.0


def reference_verify(p: torch.Tensor, q: torch.Tensor, draft: int, generator: torch.Generator) -> tuple[bool, int]:
    """The engine's own rule in the stub's shape: one request, one draft, through
    :func:`~workbench.worker.rejection_sampler.rejection_sample`."""
    target = torch.stack([p, p]).unsqueeze(0)  # row 1 (the bonus token's) is not used here
    num_accepted, token = rejection_sample(target, torch.tensor([[draft]]), torch.tensor([1]),
                                           q.view(1, 1, -1), generator)
    accepted = bool(num_accepted[0] == 1)
    return accepted, draft if accepted else int(token[0])


@dataclass(frozen=True)
class Case:
    """A target and a draft distribution over a small vocabulary (integer weights)."""

    p_weights: tuple[int, ...]
    q_weights: tuple[int, ...]

    @property
    def p(self) -> torch.Tensor:
        w = torch.tensor(self.p_weights, dtype=torch.float64)
        return (w / w.sum()).float()

    @property
    def q(self) -> torch.Tensor:
        w = torch.tensor(self.q_weights, dtype=torch.float64)
        return (w / w.sum()).float()

    def __str__(self) -> str:
        return f"p={_fmt(self.p)}, q={_fmt(self.q)}"


def _fmt(x) -> str:
    return "[" + ", ".join(f"{float(v):.3f}" for v in x) + "]"


@st.composite
def cases(draw) -> Case:
    """p and q at total-variation distance >= 0.2 (closer pairs accept almost every draft, and
    no rule's mistakes would show)."""
    size = draw(st.integers(2, 5))
    p = tuple(draw(st.lists(st.integers(0, 9), min_size=size, max_size=size).filter(any)))
    q = tuple(draw(st.lists(st.integers(0, 9), min_size=size, max_size=size).filter(any)))
    case = Case(p, q)
    assume(float((case.p - case.q).abs().sum()) / 2 >= 0.2)
    return case


@dataclass(frozen=True)
class Sample:
    """What a rule emitted over NUM_DRAWS drafts: token frequencies and the acceptance rate."""

    freq: torch.Tensor
    accept_rate: float


def sample(case: Case, verify: Callable, index: int) -> Sample:
    """Call ``verify`` NUM_DRAWS times on drafts drawn from q (both draws seeded)."""
    p, q = case.p, case.q
    drafts = torch.multinomial(q, NUM_DRAWS, replacement=True, generator=torch.Generator().manual_seed(SEED)).tolist()
    generator = torch.Generator().manual_seed(SEED + 1)
    counts = torch.zeros(len(p), dtype=torch.float64)
    accepted = 0
    for draft in drafts:
        got = call_solution(index, verify, p.clone(), q.clone(), draft, generator)
        try:
            ok, token = got
            token = int(token)
        except (TypeError, ValueError):
            raise Mismatch(index, f"case {index}: verify() must return (accepted, token), got {got!r}.") from None
        if not 0 <= token < len(p):
            raise Mismatch(index, f"case {index}: verify() returned token {token}, outside the vocabulary "
                                  f"0..{len(p) - 1} ({case}).")
        if ok and token != draft:
            raise Mismatch(index, f"case {index}: verify() accepted draft {draft} but returned token {token}; an "
                                  f"accepted draft is the token emitted ({case}).")
        counts[token] += 1
        accepted += bool(ok)
    return Sample((counts / NUM_DRAWS).float(), accepted / NUM_DRAWS)


def _z(observed: float, expected: float) -> float:
    """Standard errors between an observed frequency over NUM_DRAWS and its probability."""
    var = expected * (1 - expected) / NUM_DRAWS
    if var == 0:
        return 0.0 if abs(observed - expected) < 1e-12 else float("inf")
    return abs(observed - expected) / var ** 0.5


def grade_case(case: Case, verify: Callable, index: int) -> None:
    """Mismatch when ``verify``'s emitted distribution or acceptance rate is off."""
    got = sample(case, verify, index)
    p, q = case.p, case.q
    alpha = float(torch.minimum(p, q).sum())
    z_tokens = [_z(float(f), float(pt)) for f, pt in zip(got.freq, p)]
    z_accept = _z(got.accept_rate, alpha)
    worst = max(range(len(p)), key=lambda t: z_tokens[t])
    if z_tokens[worst] <= Z_LIMIT and z_accept <= Z_LIMIT:
        return
    ref = sample(case, reference_verify, index)
    lines = [f"case {index}: {case}, {NUM_DRAWS} drafts drawn from q."]
    if z_tokens[worst] > Z_LIMIT:
        lines.append(f"  The tokens you emit are not distributed as p: token {worst} came out {float(got.freq[worst]):.3f} "
                     f"of the time, p says {float(p[worst]):.3f} ("
                     + ("p never emits it)." if float(p[worst]) == 0 else f"{z_tokens[worst]:.1f} standard errors away)."))
    lines += [f"  Emitted frequencies, yours:     {_fmt(got.freq)}",
              f"  Emitted frequencies, reference: {_fmt(ref.freq)}  (p = {_fmt(p)})"]
    lines.append(f"  Acceptance rate: yours {got.accept_rate:.3f}, reference {ref.accept_rate:.3f}, the best possible "
                 f"sum(min(p, q)) = {alpha:.3f}" + (f" ({z_accept:.1f} standard errors away)." if z_accept > Z_LIMIT else "."))
    raise Mismatch(index, "\n".join(lines), ref, got, _view(case, index, got, ref))


def _view(case: Case, index: int, got: Sample, ref: Sample):
    def make():
        import ipywidgets as widgets
        import numpy as np

        from workbench.viz.figures import figure_png, new_figure, png_img

        fig = new_figure(6, 2.6)
        ax = fig.add_subplot(1, 1, 1)
        x = np.arange(len(case.p))
        for k, (label, values) in enumerate((("target p", case.p), ("draft q", case.q), ("reference", ref.freq),
                                             ("yours", got.freq))):
            ax.bar(x + (k - 1.5) * 0.2, values.numpy(), width=0.2, label=label)
        ax.set_xticks(x)
        ax.set_xlabel("token")
        ax.set_ylabel("probability / frequency")
        ax.set_title(f"case {index}: emitted tokens")
        ax.legend(fontsize=8)
        return widgets.HTML(png_img(figure_png(fig)))

    return make


def check_rejection(solution: Callable, *, workloads: Sequence[Case] | None = None, max_examples: int = 8,
                    hints=()) -> CheckResult:
    """Grade a ``verify`` rule on ``max_examples`` drawn (p, q) cases, or on ``workloads``."""
    numbers: dict[Case, int] = {}  # a case keeps its number when it is run again

    def run(case: Case) -> None:
        grade_case(case, solution, numbers.setdefault(case, len(numbers)))

    found = first_failure(cases(), run, max_examples=max_examples, workloads=workloads, shrink=False)
    if found is None:
        count = max_examples if workloads is None else len(workloads)
        return CheckResult("rejection", True, f"in {count} (p, q) cases of {NUM_DRAWS} drafts each, your tokens follow "
                           f"p and your acceptance rate is sum(min(p, q)).", score=f"{count}/{count} cases")
    case, m = found
    return CheckResult("rejection", False, m.message, m.step, m.expected, m.got, case, hints=hints, view=m.view,
                       unit="case")
