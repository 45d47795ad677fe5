"""Speculative decoding's acceptance by draft position over recorded steps (vLLM's
``spec_decode_num_accepted_tokens_per_pos``, read back from each StepRecord's ``spec_decode``,
so a replayed history gives the same); the run's totals are
:func:`spec_decode_summary`.
"""

from __future__ import annotations

import math


def acceptance_by_position(history) -> list[dict]:
    """One dict per draft position j (0-based): ``drafted`` (steps whose drafts reached
    position j), ``accepted`` (of those, accepted at j) and ``rate`` (accepted / drafted).
    vLLM's ``spec_decode_num_accepted_tokens_per_pos`` counts the same ``accepted``."""
    drafted: list[int] = []
    accepted: list[int] = []
    for record in history:
        for result in record.spec_decode.values():
            for j in range(result.num_draft_tokens):
                if j == len(drafted):
                    drafted.append(0)
                    accepted.append(0)
                drafted[j] += 1
                accepted[j] += j < result.num_accepted
    return [{"position": j, "drafted": d, "accepted": a, "rate": a / d}
            for j, (d, a) in enumerate(zip(drafted, accepted))]


def spec_decode_summary(records) -> dict[str, float]:
    """Speculative decoding over ``records`` (StepRecords): ``spec_num_drafts`` (verifications),
    ``spec_num_draft_tokens``, ``spec_num_accepted_tokens``, ``spec_acceptance_rate``
    (accepted / drafted tokens) and ``spec_mean_acceptance_length`` (vLLM's: tokens a
    verification emits on average, 1 + accepted / drafts); NaN rates without drafts."""
    results = [r for rec in records for r in rec.spec_decode.values()]
    drafted = sum(r.num_draft_tokens for r in results)
    accepted = sum(r.num_accepted for r in results)
    return {
        "spec_num_drafts": len(results),
        "spec_num_draft_tokens": drafted,
        "spec_num_accepted_tokens": accepted,
        "spec_acceptance_rate": accepted / drafted if drafted else math.nan,
        "spec_mean_acceptance_length": 1 + accepted / len(results) if results else math.nan,
    }
