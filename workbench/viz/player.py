"""StepPlayer: scrub through recorded steps; at step k see its batch, its events, the queues
after it and the KV pool as it was (a :class:`BlockMap` of ``history.kv_state(k)``).

With a live engine, Step / Run buttons extend the history and the player follows the newest
step (unless scrubbed back). All it shows lives in ``batch_rows`` (the chunks of step k; a
constrained row's ``grammar``: how many tokens its mask allowed and the token it forced, if
it allowed one), ``queues`` (running / waiting ids after step k) and ``notes`` (what happened
and why, grammars that became ready or are still compiling included).

One source of truth: the slider's value is the step shown. ``show(k)``, dragging, the
keyboard, the play button (linked to the slider in the kernel) and live following all move
the slider, and only its observer draws; so the readout, the "step k" text, the batch and
the block map's title always name the same step.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import traitlets

from workbench.core.kv_events import BlockAllocated, BlockFreed
from workbench.viz.block_map import BlockMap
from workbench.viz.kv_transfer import kv_transfer_notes
from workbench.viz.busy import busy
from workbench.viz.chunks import chunk_kinds, empty_batch_reason, request_adapters
from workbench.viz.colors import SPEC_COLORS, SPEC_MARKS, STATE_COLORS, assign_colors, request_chip
from workbench.viz.live import LiveUpdater
from workbench.viz.source import ViewSource
from workbench.viz.spec_decode import budget_split, draft_fates, draft_slots
from workbench.viz.why import why_rows, why_table
from workbench.viz.overlap import overlap_notes


def request_states(records, step: int) -> tuple[list[str], list[str], set[str]]:
    """Replay request events up to ``step``: (running ids, waiting ids, every id seen).
    Waiting lists preempted requests first."""
    status: dict[str, str] = {}
    seen: set[str] = set()
    for record in records:
        if record.step > step:
            break
        for event in record.request_events:
            rid = event.request_id
            seen.add(rid)
            if event.kind == "arrived":
                status[rid] = "waiting"
            elif event.kind == "scheduled":
                status[rid] = "running"
            elif event.kind == "preempted":
                status[rid] = "preempted"
            elif event.kind == "finished":
                status.pop(rid, None)
    running = [r for r, s in status.items() if s == "running"]
    waiting = [r for r, s in status.items() if s == "preempted"] + [r for r, s in status.items() if s == "waiting"]
    return running, waiting, seen


def preemption_notes(record, policy: str) -> list[str]:
    """One sentence per preemption of the step: who lost which blocks, for whom, and why."""
    notes = []
    events = list(record.kv_events)
    for event in record.request_events:
        if event.kind != "preempted":
            continue
        victim = event.request_id
        freed = [i for i, e in enumerate(events) if isinstance(e, BlockFreed) and e.request_id == victim]
        after = events[freed[-1] + 1:] if freed else []
        taker = next((e for e in after if isinstance(e, BlockAllocated) and e.request_id != victim
                      and not e.prefix_hit), None)
        needed = (f"{taker.request_id} needed a new KV block (it got block {taker.block_id}) and none was free"
                  if taker else "a running request needed a new KV block and none was free")
        notes.append(
            f"{victim} preempted: {needed}; policy {policy} picks the victim. {victim} lost blocks "
            f"{list(event.block_ids)} and the K/V of {event.num_computed_tokens} tokens, to be "
            f"recomputed (less what the prefix cache still holds) when it resumes."
        )
    return notes


def waiting_note(record, waiting: list[str], max_num_seqs: int | None, chunked_prefill: bool | None) -> str | None:
    """Why the requests still waiting after a step were not admitted in it, or None.

    The scheduler admits waiting requests only in a step that preempted nothing, while the
    token budget and ``max_num_seqs`` allow, and stops at the first whose chunk the free KV
    blocks cannot hold (no overtaking)."""
    if not waiting:
        return None
    so = record.scheduler_output
    used, budget = so.total_num_scheduled_tokens, so.token_budget
    if so.preempted_request_ids:
        why = "this step preempted, and a step that preempts admits no waiting request"
    elif used >= budget:
        why = f"the token budget was spent ({used} of {budget} tokens)"
    elif max_num_seqs is not None and len(so.scheduled) >= max_num_seqs:
        why = f"max_num_seqs={max_num_seqs} requests were already running"
    elif chunked_prefill is False:
        why = (f"the next one's whole prompt did not fit the {budget - used} tokens left of the "
               f"budget (chunked prefill is off) or the {so.num_free_blocks} free KV blocks")
    else:
        why = f"the next one's chunk did not fit the {so.num_free_blocks} free KV blocks"
    return f"{', '.join(waiting)} kept waiting: {why}."


def _grammar(record):
    """The record's structured-output step (None for records without one)."""
    return getattr(record, "structured_output", None)


def grammar_cell(grammar: dict | None) -> str:
    """A constrained row's mask: "forced 'x'" when it allowed one token, else "N allowed"."""
    if grammar is None:
        return ""
    if grammar["forced"] is not None:
        return f"<b>forced</b> <code>{html.escape(repr(grammar['forced']))}</code>"
    return f"{grammar['num_allowed']} allowed"


def grammar_notes(record) -> list[str]:
    """Grammars that became ready in the step, and requests still waiting for theirs."""
    grammar = _grammar(record)
    if not grammar:
        return []
    notes = [f"{rid}'s grammar is ready ({grammar.backends.get(rid, 'grammar')}, "
             + ("from the cache" if seconds == 0.0 else "compiled") + "); it may be scheduled."
             for rid, seconds in grammar.compiled.items()]
    if grammar.waiting_for_fsm:
        notes.append(f"{', '.join(grammar.waiting_for_fsm)} still wait for their grammar to "
                     "compile (WAITING_FOR_FSM): the scheduler passes over them.")
    return notes


def spec_notes(record) -> list[str]:
    """One sentence per speculating request of the step: drafts verified, accepted, and the
    token the target added."""
    notes = []
    for rid, result in record.spec_decode.items():
        extra = ("all accepted, plus the bonus token" if result.bonus else
                 f"{result.num_rejected} rejected from position {result.num_accepted + 1} on (their KV "
                 f"slots are reused), plus the target's recovered token")
        notes.append(f"{rid} verified {result.num_draft_tokens} draft tokens: {result.num_accepted} accepted, "
                     f"{extra}; {result.num_accepted + 1} tokens emitted in one step.")
    return notes


def drafts_html(drafts: list[dict]) -> str:
    """Each draft as its text behind its fate's mark, on its fate's colour (a rejected one's
    text struck through), then the target's token."""
    strike = {"rejected": ' style="text-decoration:line-through"'}
    return " ".join(
        f'<span class="wb-draft wb-draft-{d["fate"]}" title="{d["fate"]}: token {d["token_id"]}" '
        f'style="background:{SPEC_COLORS[d["fate"]]};color:#fff;padding:0 3px;font:11px monospace;'
        f'white-space:pre">{SPEC_MARKS[d["fate"]]}<span{strike.get(d["fate"], "")}>'
        f'{html.escape(repr(d["text"])[1:-1])}</span></span>'
        for d in drafts)


def _set_range(widget, low: int, high: int) -> None:
    """Move an int widget's [min, max] in the order that never has min > max on the way."""
    if low > widget.max:
        widget.max, widget.min = high, low
    else:
        widget.min, widget.max = low, high


class StepPlayer(widgets.VBox):
    """``StepPlayer(engine | history | run_result)``: a slider and play button over the
    recorded steps (``show(k)`` from code). It follows the newest step unless scrubbed back.

    ``live_updates`` redraws after engine steps taken elsewhere (a cell, ``%llm serve``),
    throttled; ``controls=False`` leaves out the Step / Run buttons (the dashboard has its
    own); ``outputs`` collects the finished RequestOutputs of the steps its buttons ran."""

    batch_rows = traitlets.List()
    queues = traitlets.Dict()
    notes = traitlets.List()
    step = traitlets.Int(allow_none=True, default_value=None)

    def __init__(self, source, *, tokenizer=None, controls: bool = True, live_updates: bool = True,
                 live_interval: float = 1.0):
        self.source = ViewSource(source, tokenizer)
        self.outputs: list = []
        self.block_map = BlockMap(self.source)
        self.slider = widgets.IntSlider(description="step", continuous_update=False,
                                        layout=widgets.Layout(width="480px"))
        self.play = widgets.Play(interval=600, description="play")
        widgets.link((self.play, "value"), (self.slider, "value"))
        self.position = widgets.HTML()
        self.batch = widgets.HTML()
        self.events = widgets.HTML()
        self.queue_view = widgets.HTML()
        self.status = widgets.HTML()
        self.slider.observe(lambda change: self._render(change["new"]), "value")
        self.buttons: list[widgets.Button] = []
        engine = self.source.engine
        if engine is not None and self.source.live and controls:
            for label, steps in (("Step", 1), ("Run 10", 10), ("Run to end", None)):
                button = widgets.Button(description=label, layout=widgets.Layout(width="110px"))
                button.on_click(lambda _, n=steps: self.advance(n))
                self.buttons.append(button)
        super().__init__([
            widgets.HBox([self.play, self.slider, self.position]), widgets.HBox([*self.buttons, self.status]),
            self.batch, self.events, self.queue_view, self.block_map,
        ])
        self.updater = LiveUpdater(engine, self.refresh, live_interval) \
            if engine is not None and live_updates else None
        self.refresh()

    # ----------------------------------------------------------- drive
    def advance(self, num_steps: int | None = 1) -> None:
        """Step the live engine ``num_steps`` times (None: until no request is left), then
        show the newest step. Controls are disabled (busy) while it runs."""
        engine = self.source.engine
        with busy(self.buttons, self.status, "stepping"):
            if self.updater:
                self.updater.paused = True
            try:
                count = 0
                while ((engine.has_unfinished_requests() or engine.has_unrecorded_aborts())
                       and (num_steps is None or count < num_steps)):
                    self.outputs.extend(out for out in engine.step() if out.finished)
                    count += 1
            finally:
                if self.updater:
                    self.updater.paused = False
            self.refresh()

    def refresh(self) -> None:
        """Re-read the history: the slider's range grows; follow the newest step if the
        slider was on the previous newest (or nothing was shown yet)."""
        steps = self.source.steps
        if not steps:
            pending = self.source.pending(set())
            self.step = None
            self.batch_rows, self.queues, self.notes = [], {"running": [], "waiting": [], "added": pending}, []
            self.batch.value = self.events.value = ""
            self.queue_view.value = ("<b>added</b> (they arrive in the first step): " + " ".join(map(request_chip, pending))
                                     if pending else "")
            self.slider.disabled = True
            self.position.value = "no steps recorded yet: add requests and step"
            self.block_map.refresh()
            return
        following = self.step is None or self.step >= self.slider.max or self.step < steps[0]
        self.slider.disabled = False
        with self.slider.hold_trait_notifications(), self.play.hold_trait_notifications():
            _set_range(self.slider, steps[0], steps[-1])
            _set_range(self.play, steps[0], steps[-1])
        self.show(steps[-1] if following else self.step, redraw=True)

    def show(self, step: int, *, redraw: bool = False) -> None:
        """Show step ``step`` (a recorded step number) by moving the slider there; ``redraw``
        draws it again even when the slider is already there (the history grew)."""
        if step not in self.source.steps:
            raise IndexError(f"step {step} is not recorded; the player spans steps "
                             f"{self.slider.min}–{self.slider.max}.")
        if self.slider.value != step:
            self.slider.value = step  # the observer draws
        elif redraw or self.step != step:
            self._render(step)

    def _render(self, step: int) -> None:
        """Draw step ``step``: the slider's observer, and nothing else, calls this."""
        records = self.source.records()
        record = self.source.record(step)
        self.step = step
        running, waiting, seen = request_states(records, step)
        assign_colors(e.request_id for r in records for e in r.request_events if e.kind == "arrived")
        kinds = chunk_kinds(records)
        so = record.scheduler_output
        rows = []
        grammar_rows = _grammar(record).rows if _grammar(record) else {}
        for chunk in so.scheduled:
            sampled = record.sampled_token_ids.get(chunk.request_id)
            grammar = grammar_rows.get(chunk.request_id)
            rows.append({
                "request_id": chunk.request_id, "kind": kinds[step, chunk.request_id],
                "tokens": [chunk.num_computed_tokens, chunk.seq_len], "num_new_tokens": chunk.num_new_tokens,
                "num_cached_tokens": chunk.num_cached_tokens, "block_ids": list(chunk.block_ids),
                "sampled": None if sampled is None else self.source.decode([sampled]),
                "lora": chunk.lora_name,
                "grammar": None if grammar is None else {
                    "num_allowed": grammar.num_allowed,
                    "forced": None if grammar.forced_token is None
                    else self.source.decode([grammar.forced_token])},
                "drafts": [{"token_id": t, "text": self.source.decode([t]), "fate": fate}
                           for t, fate in draft_fates(record, chunk.request_id)],
            })
        self.why_rows = why_rows(record)  # every request not fully scheduled, and why
        partial = {r["request_id"]: r["why"] for r in self.why_rows}
        for row in rows:
            row["why"] = partial.get(row["request_id"], "")
        self.batch_rows = rows
        last = self.source.last_step
        pending = self.source.pending(seen) if step == last else []
        self.queues = {"running": running, "waiting": waiting, "added": pending}
        self.notes = [n for n in [empty_batch_reason(record)] if n] + self._notes(record) + kv_transfer_notes(record) + [
            n for n in [waiting_note(record, waiting, self.source.scheduler_setting("max_num_seqs"),
                                     self.source.scheduler_setting("enable_chunked_prefill"))] if n]
        note = self.source.first_step_note()
        self.position.value = (f"step <b>{step}</b> of {self.slider.min}–{last}"
                               + (f" <small>({html.escape(note)})</small>" if note else ""))
        self.batch.value = self._batch_html(record)
        self.events.value = "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in self.notes) + "</ul>" \
            if self.notes else ""
        self.queue_view.value = (
            "<b>after this step</b> running: " + (" ".join(map(request_chip, running)) or "none")
            + " &nbsp; waiting: " + (" ".join(map(request_chip, waiting)) or "none")
            + (f" &nbsp; <b>added since step {step}</b> (they arrive in step {step + 1}): "
               + " ".join(map(request_chip, pending)) if pending else "")
        )
        lost = {b: f"lost by {e.request_id}" for e in record.request_events if e.kind == "preempted"
                for b in e.block_ids}
        self.block_map.marked = lost
        self.block_map.slots = draft_slots(record, self.source.kv_state(step).block_size)
        self.block_map.show(step)

    def _notes(self, record) -> list[str]:
        so = record.scheduler_output
        notes = []
        for event in record.request_events:
            if event.kind == "arrived":
                notes.append(f"{event.request_id} arrived ({event.num_prompt_tokens} prompt tokens).")
            elif event.kind == "prefix_hit" and event.num_tokens:
                notes.append(f"{event.request_id} found {event.num_tokens} tokens in the prefix cache "
                             f"(blocks {list(event.block_ids)}).")
            elif event.kind == "resumed":
                notes.append(f"{event.request_id} resumed after a preemption.")
            elif event.kind == "finished" and getattr(event, "pooled", False):
                notes.append(f"{event.request_id} was pooled (prefill-only: its embedding came from "
                             "this step's hidden states, no decode); its blocks were freed.")
            elif event.kind == "finished":
                notes.append(f"{event.request_id} finished ({event.reason}) with "
                             f"{event.num_output_tokens} output tokens; its blocks were freed.")
        notes += spec_notes(record) + overlap_notes(record)
        notes += preemption_notes(record, self.source.policy_name) + grammar_notes(record)
        if so.lora_skipped_request_ids:
            adapters = request_adapters(self.source.records())
            skipped = ", ".join(f"{r} ({adapters.get(r) or 'its adapter'})" for r in so.lora_skipped_request_ids)
            notes.append(f"{skipped} skipped: max_loras caps a batch at {len(so.lora_names) or 'its'} "
                         f"adapters ({', '.join(so.lora_names) or 'pinned'}); another would exceed it.")
        if so.num_blocks_evicted:
            notes.append(f"{so.num_blocks_evicted} cached blocks were evicted to serve new allocations.")
        return notes

    def _batch_html(self, record) -> str:
        so = record.scheduler_output
        used, budget = so.total_num_scheduled_tokens, so.token_budget
        split = budget_split(record)
        parts = (("prefill", "#4a7"), ("decode", "#8bc"), ("drafts", SPEC_COLORS["accepted"]))
        bar = ('<div style="display:inline-flex;width:200px;height:10px;background:#eee;border:1px solid #999">'
               + "".join(f'<div title="{kind}: {split[kind]}" style="width:{100 * split[kind] / max(budget, 1):.1f}%;'
                         f'height:100%;background:{colour}"></div>' for kind, colour in parts if split[kind])
               + "</div>")
        lora = any(r["lora"] for r in self.batch_rows)
        constrained = any(r["grammar"] for r in self.batch_rows)
        speculating = any(r["drafts"] for r in self.batch_rows)
        columns = ["request", *(["adapter"] if lora else []), "kind", "tokens [from, to)", "new",
                   "prefix hit", "block table", "sampled", *(["grammar mask"] if constrained else []),
                   *(["drafts (✓ accepted, ✕ rejected, + bonus, ↳ recovered)"] if speculating else []), "why"]
        head = "".join(f"<th>{h}</th>" for h in columns)
        body = "".join(
            "<tr>" + f"<td>{request_chip(r['request_id'])}</td>"
            + (f"<td>{html.escape(r['lora'] or '')}</td>" if lora else "") + f"<td>{r['kind']}</td>"
            f"<td>[{r['tokens'][0]}, {r['tokens'][1]})</td><td>{r['num_new_tokens']}</td>"
            f"<td>{r['num_cached_tokens'] or ''}</td><td>{' '.join(map(str, r['block_ids']))}</td>"
            f"<td><code>{html.escape(repr(r['sampled'])) if r['sampled'] is not None else ''}</code></td>"
            + (f"<td>{grammar_cell(r['grammar'])}</td>" if constrained else "")
            + (f"<td>{drafts_html(r['drafts'])}</td>" if speculating else "")
            + f"<td>{html.escape(r['why'])}</td></tr>"
            for r in self.batch_rows
        )
        if not so.scheduled:
            reason = html.escape(empty_batch_reason(record))
            return (f'<b>Step {record.step}</b>: <span style="background:{STATE_COLORS["empty batch"]};'
                    f'color:#fff;padding:0 4px">{reason}</span>' + why_table(self.why_rows))
        split_text = ", ".join(f"{split[k]} {k}" for k, _ in parts if split[k])
        return (
            f"<b>Step {record.step}</b>: {len(so.scheduled)} requests, budget used {bar} "
            f"<b>{used}</b> / {budget} tokens ({split_text}); KV usage after the step {record.kv_usage:.0%} "
            f"({record.num_free_blocks} blocks free)"
            f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>" + why_table(self.why_rows)
        )

    def close(self) -> None:
        if self.updater:
            self.updater.close()
        super().close()

    def __repr__(self) -> str:
        return f"StepPlayer(step={self.step}, steps={len(self.source.history)})"

    def _repr_html_(self) -> str:
        return "".join(f"<div>{part}</div>" for part in (
            self.position.value, self.batch.value, self.events.value, self.queue_view.value,
            self.block_map._repr_html_()))
