"""EngineDashboard: one panel to drive a live engine and watch every decision it makes.

Controls add requests (prompt, request id, max_tokens, temperature, priority), step, run and
reset; tabs show the :class:`StepPlayer` (with the :class:`BlockMap` as it was at the step
picked), the :class:`RequestTimeline`, step plots (tokens per step, KV usage and queues),
the per-request metrics and the finished outputs. It redraws after its own clicks and, via a
throttled ``engine.on_step`` hook, after steps taken elsewhere -- also while ``%llm serve``
steps the engine (``read_only=True``: no drive controls). Live redraws touch only the tab on
show, so watching costs the engine little.
"""

from __future__ import annotations

import html
import itertools

import ipywidgets as widgets
import traitlets

from workbench.sampling_params import SamplingParams
from workbench.viz.busy import busy
from workbench.viz.colors import request_chip
from workbench.viz.figures import figure_png, new_figure
from workbench.viz.live import LiveUpdater
from workbench.viz.player import StepPlayer
from workbench.viz.plots import plot_kv_usage, plot_step_tokens
from workbench.viz.source import ViewSource
from workbench.viz.timeline import RequestTimeline

def outputs_html(outputs) -> str:
    """Finished RequestOutputs as one table, a row per completion: cells top-aligned and
    rows ruled, so a multi-line text stays inside its row."""
    cell = "border-bottom:1px solid #ccc;vertical-align:top;text-align:left;padding:2px 6px"
    rows = "".join(
        f'<tr><td style="{cell}">{request_chip(out.request_id)}</td>'
        f'<td style="{cell}"><code>{html.escape(repr(out.prompt))}</code></td>'
        f'<td style="{cell};white-space:pre-wrap;font-family:monospace">{html.escape(o.text)}</td>'
        f'<td style="{cell}">{len(o.token_ids)}</td><td style="{cell}">{html.escape(str(o.finish_reason))}</td></tr>'
        for out in outputs for o in out.outputs
    )
    head = "".join(f'<th style="{cell}">{h}</th>' for h in ("request", "prompt", "text", "tokens", "finish"))
    return f'<table style="border-collapse:collapse"><tr>{head}</tr>{rows}</table>' if rows else ""


_NARROW = dict(layout=widgets.Layout(width="200px"), style={"description_width": "initial"})


class EngineDashboard(widgets.VBox):
    """``EngineDashboard(engine)``; display it in a cell. ``add`` / ``step`` / ``run_to_end``
    / ``reset`` do what the buttons do. ``summary`` is the header line shown."""

    summary = traitlets.Unicode("")
    last_added = traitlets.Unicode("")  # the id of the request the last Add made (echoed beside it)

    def __init__(self, engine, params: SamplingParams | None = None, *, read_only: bool = False,
                 live_interval: float = 1.0):
        self.engine = engine
        self.source = ViewSource(engine, live=not read_only)
        params = params or SamplingParams(temperature=0.0, max_tokens=32)
        self._ids = itertools.count()
        self.header = widgets.HTML()
        self.status = widgets.HTML()
        self.prompt = widgets.Text(value="ROMEO:", description="prompt", layout=widgets.Layout(width="340px"))
        self.request_id = widgets.Text(value="", placeholder="(made up)", description="request id",
                                       layout=widgets.Layout(width="240px"))
        self.max_tokens = widgets.BoundedIntText(value=params.max_tokens, min=1, max=100_000,
                                                 description="max_tokens", **_NARROW)
        self.temperature = widgets.BoundedFloatText(value=params.temperature, min=0.0, max=10.0, step=0.1,
                                                    description="temperature", **_NARROW)
        self.priority = widgets.IntText(value=0, description="priority", **_NARROW)
        self.player = StepPlayer(self.source, controls=False, live_updates=False)
        self.timeline = RequestTimeline(self.source)
        self.plots = widgets.Image(format="png")
        self.added = widgets.HTML()
        self.added.add_class("wb-added")
        self.requests = widgets.HTML(layout=widgets.Layout(width="100%"))
        self.finished = widgets.HTML(layout=widgets.Layout(width="100%"))
        self.outputs: list = []
        buttons = {}
        for label, action in (("Add request", self._on_add), ("Step", lambda: self.step(1)),
                              ("Run 10 steps", lambda: self.step(10)), ("Run to the end", self.run_to_end),
                              ("Reset", self.reset), ("Refresh", self.refresh)):
            button = widgets.Button(description=label, layout=widgets.Layout(width="130px"))
            button.on_click(lambda _, label=label, action=action: self._click(label, action))
            buttons[label] = button
        self.buttons = list(buttons.values())
        if read_only:
            self.buttons = [buttons["Refresh"]]
            controls = [widgets.HBox([buttons["Refresh"], self.status])]
        else:
            controls = [
                widgets.HBox([self.prompt, self.request_id, buttons["Add request"], self.added]),
                widgets.HBox([self.max_tokens, self.temperature, self.priority]),
                widgets.HBox([buttons[k] for k in ("Step", "Run 10 steps", "Run to the end", "Reset")]
                             + [self.status]),
            ]
        self.tabs = widgets.Tab([self.player, self.timeline, self.plots, self.requests, self.finished])
        for i, title in enumerate(("Step player", "Timeline", "Step plots", "Requests", "Outputs")):
            self.tabs.set_title(i, title)
        self._stale: set[int] = set()  # tabs not redrawn since the engine moved
        self.tabs.observe(lambda change: self._on_tab(change["new"]), "selected_index")
        super().__init__([self.header, *controls, self.tabs])
        self.updater = LiveUpdater(engine, lambda: self.refresh(all_tabs=False), live_interval)
        self.refresh()

    # ------------------------------------------------------------- actions
    def add(self, prompt: str, request_id: str | None = None, **params) -> str:
        """Queue a request (params: SamplingParams fields, priority); returns its id."""
        priority = params.pop("priority", 0)
        rid = request_id or self._new_id()
        self.engine.add_request(rid, prompt, SamplingParams(**params), priority=priority)
        self.last_added = rid
        last = self.source.last_step
        self.added.value = (f"added {request_chip(rid)}: waiting, it arrives in step "
                            f"{0 if last is None else last + 1}")
        self.refresh()
        return rid

    def step(self, num_steps: int = 1) -> None:
        """Advance the engine up to ``num_steps`` steps (fewer when it runs dry)."""
        self.updater.paused = True
        try:
            for _ in range(num_steps):  # an abort left unrecorded gets its step too
                if not (self.engine.has_unfinished_requests() or self.engine.has_unrecorded_aborts()):
                    break
                self.outputs.extend(out for out in self.engine.step() if out.finished)
        finally:
            self.updater.paused = False
        self.refresh()

    def run_to_end(self, max_steps: int = 10_000) -> None:
        self.step(max_steps)

    def reset(self) -> None:
        """Abort every request, forget the recorded steps and the prefix cache (the model and
        its KV pool stay allocated)."""
        self.engine.abort_request(self.engine.get_unfinished_request_ids())
        self.engine.history.clear()
        self.engine.reset_prefix_cache()
        self.outputs.clear()
        self.refresh()

    def refresh(self, *, all_tabs: bool = True) -> None:
        """Redraw the header and the tabs. ``all_tabs=False`` (the live updates) redraws only
        the tab on show; the others are redrawn when picked."""
        self._header()
        redraws = (self.player.refresh, self.timeline.refresh, self._draw_plots, self._draw_requests,
                   self._draw_outputs)
        shown = self.tabs.selected_index or 0
        for i, redraw in enumerate(redraws):
            if all_tabs or i == shown:
                redraw()
                self._stale.discard(i)
            else:
                self._stale.add(i)

    def _on_tab(self, index: int | None) -> None:
        if index in self._stale:
            self._stale.discard(index)
            (self.player.refresh, self.timeline.refresh, self._draw_plots, self._draw_requests,
             self._draw_outputs)[index]()

    def _header(self) -> None:
        engine = self.engine
        kv, scheduler = engine.kv_cache, engine.scheduler
        last = self.source.last_step
        self.summary = (
            f"policy {scheduler.policy.name}, budget {scheduler.max_num_batched_tokens} tokens / "
            f"{scheduler.max_num_seqs} seqs per step, {kv.num_blocks} KV blocks × {kv.block_size} tokens; "
            f"{len(scheduler.running)} running, {len(scheduler.waiting)} waiting, "
            + ("no steps yet" if last is None else f"last step {last}")
        )
        self.header.value = f"<b>LLMEngine</b>: {html.escape(self.summary)}"

    def _draw_requests(self) -> None:
        frame = self.source.requests()
        if frame is None or not len(frame):
            self.requests.value = "no requests yet"
            return
        table = frame.to_html(index=False, float_format=lambda v: f"{v:.4g}", na_rep="")
        self.requests.value = (
            f"<small>{len(frame.columns)} columns: scroll sideways for all of them →</small>"
            '<div class="wb-scroll" style="overflow-x:scroll;max-width:100%;border:1px solid #ccc">'
            f"{table}</div>"
        )

    def _draw_outputs(self) -> None:
        self.finished.value = outputs_html(self.outputs[-10:]) or "no finished requests yet"

    def _draw_plots(self) -> None:
        self.plots.value = self._plots_png()

    def _plots_png(self) -> bytes:
        figure = new_figure(12, 3.4)
        left, right = figure.subplots(1, 2)
        plot_step_tokens(self.engine.history, ax=left)
        plot_kv_usage(self.engine.history, ax=right, last=200)
        return figure_png(figure)

    def _new_id(self) -> str:
        while True:
            rid = f"ui-{next(self._ids)}"
            if rid not in self.engine.get_unfinished_request_ids():
                return rid

    def _on_add(self) -> None:
        self.add(self.prompt.value, self.request_id.value.strip() or None, max_tokens=self.max_tokens.value,
                 temperature=self.temperature.value, priority=self.priority.value)
        self.request_id.value = ""

    def _click(self, label: str, action) -> None:
        with busy(self.buttons, self.status, label.lower()):
            action()

    def close(self) -> None:
        self.updater.close()
        super().close()

    def __repr__(self) -> str:
        return f"EngineDashboard({self.summary})"

    def _repr_html_(self) -> str:
        return self.header.value + self.player._repr_html_()
