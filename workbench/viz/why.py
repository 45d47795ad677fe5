"""The views' "why": the StepPlayer's why column and table, and the timeline's waiting spans.

Everything here reads the records' reasons (:mod:`workbench.core.sched.explain`); nothing is
recomputed, so a view of a replayed or simulated run says what the scheduler decided.
"""

from __future__ import annotations

import html

from workbench.core.sched.explain import reason_counts
from workbench.viz.colors import request_chip


def why_rows(record) -> list[dict]:
    """Every request the step did not fully schedule: request_id, scheduled (a chunk ran),
    reason (its value) and why (the sentence)."""
    scheduled = {c.request_id for c in record.scheduler_output.scheduled}
    return [{"request_id": rid, "scheduled": rid in scheduled, "reason": w.reason.value, "why": w.sentence()}
            for rid, w in record.reasons.items()]


def why_table(rows: list[dict]) -> str:
    """The requests left out of the batch, each with why (empty when none)."""
    left_out = [r for r in rows if not r["scheduled"]]
    if not left_out:
        return ""
    body = "".join(f"<tr><td>{request_chip(r['request_id'])}</td><td><code>{html.escape(r['reason'])}</code></td>"
                   f"<td>{html.escape(r['why'])}</td></tr>" for r in left_out)
    return ("<b>not scheduled</b><table><thead><tr><th>request</th><th>reason</th><th>why</th></tr></thead>"
            f"<tbody>{body}</tbody></table>")


def annotate_waiting_spans(spans: list[dict], records) -> list[dict]:
    """The timeline's waiting and preempted spans with ``reason``: the reasons of their steps,
    most frequent first ("kv_blocks_short x3, behind_in_order x1")."""
    by_step = {r.step: r.reasons for r in records}
    for span in spans:
        if span["kind"] in ("waiting", "preempted"):
            counts = reason_counts(by_step, span["request_id"], span["start"], span["end"])
            span["reason"] = ", ".join(f"{k} x{n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return spans
