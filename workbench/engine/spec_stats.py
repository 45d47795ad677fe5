"""Speculative decoding's counts over recorded steps: acceptance by draft position and the
run's acceptance rate and mean accepted length (vLLM's ``spec_decode_num_*`` counters, here
read back from each StepRecord's ``spec_decode``), so a replayed history gives the same.
"""

from __future__ import annotations


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


def spec_summary(history) -> dict:
    """``num_drafts`` (request-steps that verified drafts), ``num_draft_tokens``,
    ``num_accepted_tokens``, ``acceptance_rate`` (accepted / drafted tokens) and
    ``mean_accepted_length`` (1 + accepted per draft: tokens a speculating step emits)."""
    drafts = [res for record in history for res in record.spec_decode.values()]
    tokens = sum(r.num_draft_tokens for r in drafts)
    accepted = sum(r.num_accepted for r in drafts)
    return {"num_drafts": len(drafts), "num_draft_tokens": tokens, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / tokens if tokens else 0.0,
            "mean_accepted_length": 1 + accepted / len(drafts) if drafts else 0.0}
