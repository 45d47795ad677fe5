"""RequestTimeline: one row per request, what it did at every step.

Span kinds (``[start, end)`` in steps): ``waiting`` (arrived, not yet scheduled),
``waiting_for_fsm`` (waiting for its grammar to compile, vLLM's WAITING_FOR_FSM; the span's
``compile_s`` is the compile's seconds, None while it still compiles), ``prefill``
(a prompt chunk), ``recompute`` (a chunk re-computing tokens a preemption dropped),
``decode`` (consecutive one-token steps, merged), ``preempted`` (from preemption to
resumption), ``waiting_for_remote_kvs`` (vLLM's WAITING_FOR_REMOTE_KVS: from the step its
KV load started to the step it landed, with the transfer's ``num_bytes`` and modelled
``seconds``), ``kv_held`` (a producer's finished request whose blocks wait for a peer to read
them: from its finish to the step that learned they were read). ``finish`` marks the step a
request finished, with its reason ("pooled" for a pooling request, whose prefill chunks -- it
never decodes -- carry ``pooled: True`` and are drawn outlined). With speculative
decoding a decode span also keeps ``emitted``, the tokens each of its steps gave the request
(accepted drafts plus the sampled token), drawn as a number in each step's column. Spans are derived
from the request events each StepRecord carries, so a replayed history draws the same rows.
The x axis spans exactly the kept steps (what the player's slider spans), plus one column
for the next step while requests wait that no step has seen yet.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import traitlets
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from workbench.viz.chunks import chunk_kinds, empty_batch_reason, request_adapters, request_label
from workbench.viz.colors import STATE_COLORS, assign_colors, request_color, text_color
from workbench.viz.encoding import CHUNK_HATCH, chunk_handles
from workbench.viz.figures import figure_png, new_figure, png_img
from workbench.viz.source import ViewSource
from workbench.viz.spec_decode import emitted_tokens
from workbench.viz.why import annotate_waiting_spans

FINISH_MARKERS = {"stop": "o", "length": "D", "abort": "X", "pooled": "P"}
FSM_HATCH = "////"  # waiting for the grammar (WAITING_FOR_FSM)
REMOTE_KV_HATCH = "..."  # waiting for remote KV (WAITING_FOR_REMOTE_KVS), blocks held for a peer


def request_spans(history) -> tuple[list[str], list[dict]]:
    """``(rows, spans)`` from a history's request events: request ids in arrival order, and
    dicts with request_id, kind, start, end (steps, end exclusive), tokens, reason. A
    ``finish`` span covers the step that finished the request. When any step speculated,
    decode spans also hold ``emitted`` (tokens per step of the span; the finishing step's
    count is cut to the request's output length when a stop fired inside an accepted run)."""
    rows: list[str] = []
    spans: list[dict] = []
    open_since: dict[str, tuple[str, int]] = {}  # request -> (waiting|preempted, since step)
    last_span: dict[str, dict] = {}  # request -> its latest chunk span
    kinds = chunk_kinds(history)
    last_step = history[-1].step if len(history) else 0
    speculative = any(record.spec_decode for record in history)
    num_emitted: dict[str, int] = {}  # request -> tokens the recorded steps gave it

    def close(rid: str, step: int) -> None:
        if rid in open_since:
            kind, since = open_since.pop(rid)
            if step > since:
                spans.append({"request_id": rid, "kind": kind, "start": since, "end": step,
                              "tokens": 0, "reason": ""})

    fsm_since: dict[str, int] = {}  # request -> step it began waiting for its grammar
    kv_since: dict[str, tuple[int, object]] = {}  # request -> (step its KV load began, the transfer)
    finished_at: dict[str, int] = {}  # request -> the step it finished (a producer's held blocks)

    def close_fsm(rid: str, step: int, seconds: float | None) -> None:
        since = fsm_since.pop(rid)
        if step > since:
            spans.append({"request_id": rid, "kind": "waiting_for_fsm", "start": since,
                          "end": step, "tokens": 0, "reason": "", "compile_s": seconds})
        if rid in open_since:
            open_since[rid] = (open_since[rid][0], step)

    for record in history:
        grammar = getattr(record, "structured_output", None)
        for rid, seconds in (grammar.compiled.items() if grammar else ()):
            if rid in fsm_since:  # ready at the start of this step
                close_fsm(rid, record.step, seconds)
        for event in record.request_events:
            rid, step = event.request_id, event.step
            emitted = emitted_tokens(record, rid) if event.kind == "scheduled" and speculative else 0
            if rid not in last_span and rid not in rows:
                rows.append(rid)
            if event.kind == "arrived":
                open_since[rid] = ("waiting", step)
            elif event.kind == "scheduled":
                close(rid, step)
                kind = kinds[step, rid]
                previous = last_span.get(rid)
                num_emitted[rid] = num_emitted.get(rid, 0) + emitted
                if kind == "decode" and previous and previous["kind"] == "decode" and previous["end"] == step:
                    previous["end"] = step + 1
                    previous["tokens"] += event.num_tokens
                    if speculative:
                        previous["emitted"].append(emitted)
                else:
                    last_span[rid] = {"request_id": rid, "kind": kind, "start": step, "end": step + 1,
                                      "tokens": event.num_tokens, "reason": ""}
                    if speculative and kind == "decode":
                        last_span[rid]["emitted"] = [emitted]
                    spans.append(last_span[rid])
            elif event.kind == "preempted":
                open_since[rid] = ("preempted", step)
            elif event.kind == "finished":
                span = last_span.get(rid)
                surplus = num_emitted.get(rid, 0) - event.num_output_tokens
                if surplus > 0 and span is not None and span.get("emitted") and span["end"] == step + 1:
                    span["emitted"][-1] = max(0, span["emitted"][-1] - surplus)
                close(rid, step + 1)
                finished_at[rid] = step
                if rid in fsm_since:  # its grammar failed to compile
                    close_fsm(rid, step + 1, None)
                pooled = getattr(event, "pooled", False)
                if pooled:  # prefill-only: its chunks are marked
                    for chunk in spans:
                        if chunk["request_id"] == rid and chunk["kind"] in ("prefill", "recompute"):
                            chunk["pooled"] = True
                spans.append({"request_id": rid, "kind": "finish", "start": step, "end": step + 1,
                              "tokens": event.num_output_tokens,
                              "reason": "pooled" if pooled else event.reason})
        _kv_transfer_spans(record, spans, open_since, kv_since, finished_at)
        for rid in (grammar.waiting_for_fsm if grammar else ()):
            if rid not in fsm_since and rid in open_since:
                fsm_since[rid] = open_since[rid][1]
    for rid in list(fsm_since):
        close_fsm(rid, last_step + 1, None)
    for rid in list(open_since):
        close(rid, last_step + 1)
    order = {rid: i for i, rid in enumerate(rows)}
    spans.sort(key=lambda s: (order[s["request_id"]], s["start"]))
    return rows, spans


def _kv_transfer_spans(record, spans, open_since, kv_since, finished_at) -> None:
    """The KV connector's spans of one record (see the module docstring)."""
    kv = getattr(record, "kv_connector_output", None)
    if kv is None:
        return
    for t in kv.transfers:
        kv_since[t.request_id] = (record.step, t)
    for rid in sorted(kv.finished_recving):
        if rid in kv_since:
            since, t = kv_since.pop(rid)
            spans.append({"request_id": rid, "kind": "waiting_for_remote_kvs", "start": since,
                          "end": record.step + 1, "tokens": 0, "reason": "", "num_bytes": t.num_bytes,
                          "seconds": t.seconds})
            if rid in open_since:  # waiting again (for a slot) only after the load
                open_since[rid] = (open_since[rid][0], record.step + 1)
    for rid in sorted(kv.finished_sending):
        if rid in finished_at:
            spans.append({"request_id": rid, "kind": "kv_held", "start": finished_at[rid],
                          "end": record.step + 1, "tokens": 0, "reason": ""})


def empty_steps(records) -> list[int]:
    """The steps whose batch was empty (no request ran)."""
    return [r.step for r in records if empty_batch_reason(r)]


def draw_timeline(ax, rows: list[str], spans: list[dict], *, steps: tuple[int, int], empty: list[int] = (),
                  title: str = "", adapters: dict[str, str] | None = None) -> None:
    """Draw ``request_spans`` output on ``ax`` over ``steps`` = (first, last), both drawn:
    row i (top = first arrival) is rows[i]; step s is the column centred on tick s, as in the
    step plot; a finish marker sits on the finishing step; empty batches are shaded columns."""
    assign_colors(rows)
    y = {rid: len(rows) - 1 - i for i, rid in enumerate(rows)}
    for step in empty:
        ax.axvspan(step - 0.5, step + 0.5, color=STATE_COLORS["empty batch"], alpha=0.25, linewidth=0)
    for span in spans:
        row = y[span["request_id"]]
        width = span["end"] - span["start"]
        left = span["start"] - 0.5
        colour = request_color(span["request_id"])
        kind = span["kind"]
        if kind == "waiting":
            ax.barh(row, width, left=left, height=0.35, color=STATE_COLORS["waiting"])
        elif kind == "waiting_for_fsm":
            ax.barh(row, width, left=left, height=0.35, color=STATE_COLORS["waiting"],
                    hatch=FSM_HATCH, edgecolor="black", linewidth=0)
        elif kind in ("waiting_for_remote_kvs", "kv_held"):
            ax.barh(row, width, left=left, height=0.35,
                    color=STATE_COLORS["waiting" if kind == "waiting_for_remote_kvs" else "cached"],
                    hatch=REMOTE_KV_HATCH, edgecolor="black", linewidth=0)
        elif kind == "preempted":
            ax.barh(row, width, left=left, height=0.35, color="none",
                    edgecolor=STATE_COLORS["preempted"], hatch="xxx", linewidth=0)
        elif kind == "decode":
            ax.barh(row, width, left=left, height=0.8, color=colour)
            for i, count in enumerate(span.get("emitted", ())):  # tokens emitted in each step
                ax.text(span["start"] + i, row, str(count), ha="center", va="center", fontsize=7,
                        color=text_color(colour), fontweight="bold" if count > 1 else "normal")
        elif kind in ("prefill", "recompute"):
            ax.barh(row, width - 0.1, left=left, height=0.8, color=colour, hatch=CHUNK_HATCH[kind],
                    edgecolor="black", linewidth=1.6 if span.get("pooled") else 0.3)
        elif kind == "finish":
            ax.plot(span["start"], row, marker=FINISH_MARKERS.get(span["reason"], "o"), color="black",
                    markerfacecolor="white", markersize=7, markeredgewidth=1.5, linestyle="none", zorder=3)
    n = len(rows)
    every = max(1, n // 40)
    ax.set_yticks([y[r] for r in rows[::every]],
                  [request_label(r, adapters or {}) for r in rows[::every]], fontsize=7 if n > 20 else 9)
    ax.set_ylim(-0.6, max(n, 1) - 0.4)
    ax.set_xlim(steps[0] - 0.6, steps[1] + 0.6)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title)


def timeline_legend(figure) -> None:
    handles = [
        Patch(color=STATE_COLORS["waiting"], label="waiting"),
        Patch(facecolor=STATE_COLORS["waiting"], edgecolor="black", hatch=FSM_HATCH,
              linewidth=0, label="waiting for its grammar (FSM)"),
        Patch(facecolor=STATE_COLORS["waiting"], edgecolor="black", hatch=REMOTE_KV_HATCH,
              linewidth=0, label="waiting for remote KV"),
        Patch(facecolor=STATE_COLORS["cached"], edgecolor="black", hatch=REMOTE_KV_HATCH,
              linewidth=0, label="blocks held for a peer"),
        *chunk_handles(),
        Patch(facecolor="none", edgecolor=STATE_COLORS["preempted"], hatch="xxx", label="preempted"),
        Patch(color=STATE_COLORS["empty batch"], alpha=0.25, label="empty batch (nothing ran)"),
    ] + [Line2D([], [], marker=m, color="black", markerfacecolor="white", linestyle="none",
                label=f"finished: {r}") for r, m in FINISH_MARKERS.items()]
    figure.legend(handles=handles, loc="outside lower center", ncols=5, fontsize="small")


def timeline_height(num_rows: int) -> float:
    """Inches: 0.28 per row up to 30 rows, then 0.12 per row (100+ rows stay readable)."""
    return 1.8 + (0.28 * num_rows if num_rows <= 30 else 8.4 + 0.12 * (num_rows - 30))


class RequestTimeline(widgets.VBox):
    """``RequestTimeline(engine | history | run_result)``: the figure of every request's life
    (colour = the request, as in every view) and, for the request picked, its metrics and the
    text it generated so far. ``rows`` / ``spans`` hold what is drawn (see :func:`request_spans`),
    the ``last`` steps of a long history (a served engine keeps thousands)."""

    rows = traitlets.List()
    spans = traitlets.List()
    pending = traitlets.List()  # requests added since the last step (no step has seen them)
    step_range = traitlets.List()  # [first, last] recorded step drawn ([] before any)
    selected_request = traitlets.Unicode("")

    def __init__(self, source, *, tokenizer=None, width: float = 11.0, last: int | None = 200):
        self.source = ViewSource(source, tokenizer)
        self.width = width
        self.last = last
        self.image = widgets.Image(format="png")
        self.picker = widgets.Dropdown(options=[("(pick a request)", "")], description="request",
                                       layout=widgets.Layout(width="260px"))
        self.details = widgets.HTML()
        self.picker.observe(lambda change: self.select_request(change["new"]), "value")
        super().__init__([self.image, self.picker, self.details])
        self.refresh()

    def refresh(self) -> None:
        """Re-derive the rows from the history and redraw the ``last`` steps (None: all) and
        the requests active in them; requests added since the last step wait in the next
        step's column."""
        records = self.source.records()
        rows, spans = request_spans(records)
        spans = annotate_waiting_spans(spans, records)
        if self.last and len(records) > self.last:
            records = records[-self.last:]
            first = records[0].step
            spans = [dict(s, start=max(s["start"], first)) for s in spans if s["end"] > first]
            rows = [r for r in rows if any(s["request_id"] == r for s in spans)]
        pending = self.source.pending(set(rows))
        last = records[-1].step if records else -1
        spans += [{"request_id": rid, "kind": "waiting", "start": last + 1, "end": last + 2, "tokens": 0,
                   "reason": ""} for rid in pending]
        self.rows, self.spans, self.pending = rows + pending, spans, pending
        self.step_range = [records[0].step, last] if records else []
        figure = new_figure(self.width, timeline_height(len(self.rows)))
        ax = figure.add_subplot()
        if self.rows:
            first = records[0].step if records else 0
            draw_timeline(ax, self.rows, self.spans, steps=(first, last + 1 if pending else last),
                          empty=empty_steps(records), title=self._title(records, pending),
                          adapters=request_adapters(self.source.records()))
            timeline_legend(figure)
        else:
            ax.set_title("no requests yet")
            ax.axis("off")
        self.image.value = figure_png(figure)
        with self.picker.hold_trait_notifications():
            self.picker.options = [("(pick a request)", "")] + [(r, r) for r in self.rows]
            self.picker.value = self.selected_request if self.selected_request in self.rows else ""
        self._describe()

    def _title(self, records, pending: list[str]) -> str:
        title = "Requests by step (one colour per request)"
        if records:
            title += f", steps {records[0].step}–{records[-1].step}"
            if self.last and len(self.source.history) > len(records):
                title += f" (the last {self.last})"
        if pending:
            title += f"; {', '.join(pending)} added, waiting for step {records[-1].step + 1 if records else 0}"
        if any("emitted" in s for s in self.spans):
            title += "\nspeculative decoding: the number in each decode step is the tokens it emitted"
        note = self.source.first_step_note()
        return title + (f"\n{note}" if note and not (self.last and len(self.source.history) > len(records)) else "")

    def select_request(self, request_id: str) -> None:
        self.selected_request = request_id or ""
        if self.picker.value != self.selected_request and self.selected_request in self.rows:
            self.picker.value = self.selected_request
        self._describe()

    def output_token_ids(self, request_id: str) -> list[int]:
        """Tokens the recorded steps gave the request, accepted drafts before each sampled
        token (a preempted request keeps its tokens, so this is its output so far)."""
        tokens: list[int] = []
        for record in self.source.history:
            if request_id in record.sampled_token_ids:
                result = record.spec_decode.get(request_id)
                tokens += result.accepted_token_ids if result is not None else ()
                tokens.append(record.sampled_token_ids[request_id])
        return tokens

    def _describe(self) -> None:
        rid = self.selected_request
        if not rid:
            self.details.value = ""
            return
        own = [s for s in self.spans if s["request_id"] == rid]
        chunks = ", ".join(f"{s['kind']} {s['start']}" + (f"–{s['end'] - 1}" if s["end"] - s["start"] > 1 else "")
                           + (f" ({s['tokens']} tok)" if s["tokens"] and s["kind"] != "finish" else "")
                           + _compile_note(s)
                           + (f" (why: {s['reason']})" if s["kind"] in ("waiting", "preempted") and s["reason"] else "")
                           for s in own if s["kind"] != "finish")
        finish = next((s for s in own if s["kind"] == "finish"), None)
        metrics = self.source.request_row(rid)
        table = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>"
                        for k, v in metrics.items())
        text = self.source.decode(self.output_token_ids(rid))
        self.details.value = (
            f"<b>{html.escape(rid)}</b>: {html.escape(chunks)}"
            + (f"; finished ({html.escape(finish['reason'])}) at step {finish['start']}" if finish else "; unfinished")
            + f"<br>text so far: <code>{html.escape(repr(text))}</code>"
            + (f"<table>{table}</table>" if table else "")
        )

    def __repr__(self) -> str:
        return f"RequestTimeline({len(self.rows)} requests, {len(self.spans)} spans)"

    def _repr_html_(self) -> str:
        return png_img(self.image.value) + self.details.value


def _compile_note(span: dict) -> str:
    if span["kind"] != "waiting_for_fsm":
        return ""
    seconds = span.get("compile_s")
    return (" (grammar still compiling)" if seconds is None
            else f" (grammar compiled in {seconds * 1000:.1f} ms)")


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
