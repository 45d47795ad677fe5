"""Speculative decoding in the simulator: how often drafts come and how many are accepted,
measured on a real run (:class:`SpecDecodeProfile`), drawn per step by the simulated engine.

A profile holds ``draft_rate`` (of a real run's decode steps that could verify drafts, the
fraction that had drafts: prompt lookup finds no match in some; a draft model always has
some) and ``acceptance_rates[j]``: the probability that draft position j (0-based) is
accepted given that the drafts before it were (so a step accepts ``m`` drafts with
probability ``r0 * ... * r(m-1) * (1 - rm)``). Positions past those measured take the last
rate. :class:`SimulatedProposer` proposes ``num_speculative_tokens`` filler tokens for a
request with probability ``draft_rate``, never past its drawn output length, and the
SimulatedRunner draws each verified step's accepted count from ``acceptance_rates``. Draws
come from one seeded generator, so a simulation is reproducible.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from workbench.metrics.spec_stats import acceptance_by_position
from workbench.lab.sim.measurements import records_of
from workbench.request import Request


@dataclass(frozen=True)
class SpecDecodeProfile:
    """Measured draft availability and per-position conditional acceptance (see module)."""

    draft_rate: float
    acceptance_rates: tuple[float, ...]

    def __post_init__(self) -> None:
        if not 0.0 <= self.draft_rate <= 1.0:
            raise ValueError(f"draft_rate must be in [0, 1], got {self.draft_rate!r}.")
        rates = tuple(float(r) for r in self.acceptance_rates)
        if not rates or not all(0.0 <= r <= 1.0 for r in rates):
            raise ValueError(f"acceptance_rates must be one or more probabilities in [0, 1], got {rates!r}.")
        object.__setattr__(self, "acceptance_rates", rates)

    @classmethod
    def from_run(cls, run) -> SpecDecodeProfile:
        """Measured on real runs with speculative decoding: a RunResult, a StepHistory, or a
        list of them (:func:`~workbench.lab.sim.measurements.records_of`)."""
        records = records_of(run)
        drafted = sum(len(r.spec_decode) for r in records)
        if not drafted:
            raise ValueError("the run verified no drafts: measure a SpecDecodeProfile on a real run "
                             "with speculative_config (and prompts where drafts are found).")
        # A decode step that sampled could have speculated; those that verified drafts did.
        decodes = sum(1 for r in records for c in r.scheduler_output.scheduled if c.samples and not c.is_prefill)
        reached = [0] * max(res.num_draft_tokens for r in records for res in r.spec_decode.values())
        for record in records:  # drafts whose earlier positions were all accepted
            for res in record.spec_decode.values():
                for j in range(min(res.num_accepted + 1, res.num_draft_tokens)):
                    reached[j] += 1
        accepted = [row["accepted"] for row in acceptance_by_position(records)]
        # a position no draft reached says nothing: it and those after take the last rate
        rates = [a / n for a, n in zip(accepted, reached) if n]
        return cls(draft_rate=min(1.0, drafted / max(decodes, 1)), acceptance_rates=tuple(rates))

    def rate(self, position: int) -> float:
        return self.acceptance_rates[min(position, len(self.acceptance_rates) - 1)]

    def draw_accepted(self, num_drafts: int, rng: np.random.Generator) -> int:
        """How many of ``num_drafts`` drafts a step accepts (a prefix), drawn."""
        for j in range(num_drafts):
            if rng.random() >= self.rate(j):
                return j
        return num_drafts

    def expected_accepted_length(self, k: int) -> float:
        """1 + the expected accepted drafts of ``k``: the tokens a speculating step emits."""
        total, survive = 1.0, 1.0
        for j in range(k):
            survive *= self.rate(j)
            total += survive
        return total


class SimulatedProposer:
    """The engine's proposer in a simulation: ``k`` filler drafts for a request with
    probability ``profile.draft_rate`` (the runner's filler, so an accepted draft never stops
    a request), at most up to the request's drawn output length."""

    def __init__(self, runner, profile: SpecDecodeProfile, k: int, rng: np.random.Generator) -> None:
        self.runner, self.profile, self.k, self.rng = runner, profile, k, rng

    def propose(self, requests: Iterable[Request]) -> dict[str, list[int]]:
        out = {}
        for request in requests:
            if self.rng.random() >= self.profile.draft_rate:
                continue
            room = self.k
            target = self.runner.output_length(request)
            if target is not None:
                room = min(room, target - request.num_output_tokens - 1)
            if room > 0:
                out[request.request_id] = [self.runner.filler(request)] * room
        return out

    def remove(self, request_ids: Iterable[str]) -> None:
        """Nothing is kept per request."""

    def __repr__(self) -> str:
        return f"SimulatedProposer(k={self.k}, {self.profile})"
