"""Async scheduling seen: the engine thread's host work beside the worker's forwards, and the
one-step-behind effects of each step in words (the StepPlayer's notes).

Read only from ``StepRecord.overlap`` (:class:`~workbench.engine.batch_queue.StepOverlap`):
its spans place, on one time axis, each step's "schedule", the engine thread's "wait" for its
batch and its "update" (update, outputs, record) on the host lane, and its "forward" on the
worker lane; a schedule drawn inside the forward above it is host work hidden under compute.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure

from workbench.viz.figures import new_figure

#: Colours of the host stages and of the forward.
OVERLAP_COLORS = {"schedule": "#4a7fb5", "wait": "#cccccc", "update": "#6aa84f", "forward": "#e69138"}
LANES = ("worker: forward", "engine thread")


def overlap_notes(record) -> list[str]:
    """The one-step-behind effects of one step of async scheduling, one sentence each (none for
    a synchronous step)."""
    overlap = record.overlap
    if overlap is None:
        return []
    notes = []
    if overlap.scheduled_under is not None:
        notes.append(f"Step {record.step} was scheduled while step {overlap.scheduled_under} was in flight "
                     "(async scheduling).")
    if overlap.placeholders:
        notes.append(f"{', '.join(overlap.placeholders)}: the input token was a placeholder, the token "
                     f"step {record.step - 1} was still sampling; the worker filled it in before the forward.")
    if overlap.deferred:
        notes.append(f"{', '.join(overlap.deferred)} needed that token on the host (a grammar, penalties or "
                     f"min_tokens): this batch started only after step {record.step - 1}'s update.")
    if overlap.discarded:
        notes.append(f"{', '.join(overlap.discarded)} had already finished (a stop found one step late): the "
                     "token this step computed for it was dropped.")
    return notes


def overlap_spans(records: Sequence) -> list[tuple[str, int, str, float, float]]:
    """(lane, step, stage, start ms, end ms) of every span of the records of async
    scheduling, from the first span's start."""
    rows = [(LANES[0] if stage == "forward" else LANES[1], r.step, stage, start, end)
            for r in records if r.overlap is not None
            for stage, (start, end) in r.overlap.spans.items()]
    origin = min((row[3] for row in rows), default=0.0)
    return [(lane, step, stage, 1e3 * (a - origin), 1e3 * (b - origin)) for lane, step, stage, a, b in rows]


def draw_overlap(ax, records: Sequence) -> None:
    """Both lanes on ``ax``: one bar per span, each labelled with its step."""
    for lane, step, stage, start, end in overlap_spans(records):
        y = LANES.index(lane)
        ax.broken_barh([(start, max(end - start, 1e-3))], (y - 0.35, 0.7),
                       facecolors=OVERLAP_COLORS[stage], edgecolor="white", linewidth=0.5)
        if stage in ("schedule", "forward"):
            ax.text(start, y + 0.4, str(step), fontsize=7, va="bottom")
    ax.set_yticks(range(len(LANES)), LANES)
    ax.set_ylim(-0.6, len(LANES) - 0.2)
    ax.set_xlabel("ms")
    handles = [ax.bar(0, 0, color=c, label=s) for s, c in OVERLAP_COLORS.items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)


def overlap_figure(records: Sequence, width: float = 10.0) -> Figure:
    """A figure of :func:`draw_overlap` (a figure this module owns, never pyplot's)."""
    figure = new_figure(width, 2.2)
    ax = figure.add_subplot()
    draw_overlap(ax, records)
    ax.set_title("async scheduling: each step's host work beside the forwards "
                 "(the number: its step)", fontsize=9)
    return figure
