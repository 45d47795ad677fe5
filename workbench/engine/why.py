"""explain(request_id): one request's story step by step, read from the StepRecords' why.

:func:`explain_request` walks the records (a live engine's history, a replayed one or a
simulated run's: the same records give the same answer) and returns a
:class:`RequestExplanation`: ``.table`` (a pandas DataFrame, one row per step the request
was in the scheduler: step, state, reason, tokens scheduled, the reason's numbers, a note
for its admission's prefix lookup or its preemption) and ``str()``, the same in sentences,
consecutive steps with the same state and reason told once.

States: "scheduled" (all its known tokens), "partial" (a chunk), "running" (running, left
out), "waiting", "preempted" (in this step), "finished" (finished in this step).
"""

from __future__ import annotations

from collections.abc import Iterable

from workbench.core.sched.explain import numbers

COLUMNS = ("step", "state", "reason", "tokens", "numbers", "note")


class RequestExplanation:
    """A request's steps (rows) and their sentences (see the module docstring)."""

    def __init__(self, request_id: str, rows: list[dict], sentences: list[str]) -> None:
        self.request_id = request_id
        self.rows = rows
        self.sentences = sentences

    @property
    def table(self):
        import pandas as pd

        return pd.DataFrame(self.rows, columns=list(COLUMNS))

    def __str__(self) -> str:
        return "\n".join(self.sentences)

    def __repr__(self) -> str:
        return f"RequestExplanation({self.request_id!r}, {len(self.rows)} steps)"

    def _repr_html_(self) -> str:
        import html

        items = "".join(f"<li>{html.escape(s)}</li>" for s in self.sentences[1:])
        return f"<b>{html.escape(self.sentences[0])}</b><ul>{items}</ul>"


def explain_request(records: Iterable, request_id: str, step: int | None = None) -> RequestExplanation:
    """The explanation of ``request_id`` over ``records`` (oldest first); ``step``: that step only.
    ValueError when the request appears in none of them."""
    rows: list[dict] = []
    running = False  # the request's queue after the previous record
    waiting = False  # in the waiting queue: arrived or preempted, not scheduled since
    for record in records:
        so = record.scheduler_output
        why = so.explanation
        reasons = why.reasons if why is not None else {}
        chunk = next((c for c in so.scheduled if c.request_id == request_id), None)
        reason = reasons.get(request_id)
        waiting = waiting or any(e.kind == "arrived" and e.request_id == request_id for e in record.request_events)
        if reason is None and chunk is None and waiting and why is not None:
            reason = why.waiting_reason  # far back in a long queue: the reason it shared
        note = _note(why, request_id)
        finished = request_id in record.finished_request_ids
        if chunk is None and reason is None and not finished and not note:
            continue
        if request_id in so.preempted_request_ids:
            state = "preempted"
        elif chunk is not None:
            state = "partial" if reason is not None else "scheduled"
        else:
            state = "running" if running else "waiting"
        if finished:
            state = "finished"
        running = (chunk is not None or state == "running") and state not in ("preempted", "finished")
        waiting = (waiting and chunk is None or state == "preempted") and state != "finished"
        if step is not None and record.step != step:
            continue
        rows.append({
            "step": record.step, "state": state,
            "reason": "" if reason is None else reason.reason.value,
            "tokens": 0 if chunk is None else chunk.num_new_tokens,
            "numbers": {} if reason is None else numbers(reason),
            "note": note,
            "_why": reason,
        })
    if not rows:
        where = f"step {step}" if step is not None else "the recorded steps"
        raise ValueError(f"request {request_id!r} is not in {where}.")
    sentences = [f"Request {request_id}" + (f" at step {step}:" if step is not None else ":")]
    start = 0
    for i in range(1, len(rows) + 1):  # runs of equal (state, reason, note-free) rows
        if i < len(rows) and _same(rows[start], rows[i]):
            continue
        sentences.append(_sentence(rows[start:i]))
        start = i
    for row in rows:
        del row["_why"]
    return RequestExplanation(request_id, rows, sentences)


def _note(why, request_id: str) -> str:
    if why is None:
        return ""
    notes = [p.sentence() for p in why.preemptions if p.request_id == request_id]
    notes += [p.sentence() for p in why.prefix_lookups if p.request_id == request_id]
    return "; ".join(notes)


def _same(a: dict, b: dict) -> bool:
    return (a["state"], a["_why"], a["note"]) == (b["state"], b["_why"], b["note"]) and not a["note"]


def _sentence(run: list[dict]) -> str:
    first, last = run[0]["step"], run[-1]["step"]
    steps = f"Step {first}" if first == last else f"Steps {first}-{last}"
    row = run[0]
    text = f"{steps}: {row['state']}"
    tokens = sum(r["tokens"] for r in run)
    if tokens and row["state"] != "preempted":
        text += f" ({tokens} token{'s' if tokens > 1 else ''})"
    if row["_why"] is not None and row["state"] != "preempted":  # a preemption's note says why
        text += f", because {row['_why'].sentence()}"
    if row["note"]:
        text += f": {row['note']}"
    return text + "."
