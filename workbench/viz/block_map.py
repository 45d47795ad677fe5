"""BlockMap: the KV block pool as a grid of cells, as it was after any recorded step.

Each block is in one state (:func:`workbench.core.kv_state.block_state`): ``used`` (one owner),
``shared`` (ref_count > 1), ``cached`` (free but still holding a prefix hash: a later prompt can
hit it until it is evicted), ``free`` (free, no content) or ``never used`` (still in its first
place in the free queue). Free and cached blocks are numbered by their place in the eviction
order (``#1`` is reused next).

The grid shows blocks ``0 .. highest ever-used id`` (blocks are handed out from low ids, so a
pool of thousands zooms to the part in play) and a summary row counts every block per state.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import traitlets

from workbench.core.kv_state import BLOCK_STATES, block_state, never_used_blocks
from workbench.viz.chunks import request_adapters, request_label
from workbench.viz.colors import (
    SPEC_COLORS, SPEC_MARKS, STATE_COLORS, assign_colors, color_rank, request_color, text_color,
)
from workbench.viz.source import ViewSource


def block_cells(state) -> list[dict]:
    """One dict per block of a KV state: block_id, state (:func:`block_state`), ref_count,
    owners, hash (hex or None), num_tokens, evict_rank (1 = evicted next; None while in use)."""
    rank = {block_id: i + 1 for i, block_id in enumerate(state.free_queue)}
    untouched = never_used_blocks(state.free_queue, state.num_blocks)
    return [
        {
            "block_id": block.block_id,
            "state": block_state(block, never_used=block.block_id in untouched),
            "ref_count": block.ref_count,
            "owners": list(block.owners),
            "hash": block.block_hash.hex() if block.block_hash is not None else None,
            "num_tokens": len(block.token_ids),
            "evict_rank": rank.get(block.block_id),
        }
        for block in state.blocks
    ]


#: Characters of an owner's name a cell shows; longer names are elided in the middle.
CELL_NAME_CHARS = 8


def cell_name(request_id: str, width: int = CELL_NAME_CHARS) -> str:
    """The name as a cell shows it: whole when it fits ``width`` characters, else its head
    and tail around an ellipsis "…" (the full name is in the cell's tooltip)."""
    if len(request_id) <= width:
        return request_id
    tail = (width - 1) // 2
    return request_id[: width - 1 - tail] + "…" + request_id[-tail:]


def slot_strip(slots: dict[int, tuple[str, str]], block_size: int) -> str:
    """A block's slots as one character each: ``·`` for a slot no draft wrote this step,
    else the draft's fate mark (``✓`` accepted, ``✕`` rejected: reused by the next step),
    coloured by fate."""
    return "".join(
        f'<span style="color:{SPEC_COLORS[slots[i][1]]};font-weight:bold">{SPEC_MARKS[slots[i][1]]}</span>'
        if i in slots else '<span style="color:#000">·</span>' for i in range(block_size))


def held_blocks(cells: list[dict], records, step: int | None, *, during_forward: bool = False) -> set[int]:
    """Blocks held for a peer's KV transfer (prefill/decode disaggregation): owned by a request
    that had finished by then -- a finished request frees its blocks in its last step unless its
    KV connector keeps them until the consumer has read them (``kv_producer``)."""
    if step is None:
        return set()
    finished = {e.request_id for r in records if r.step < step or (r.step == step and not during_forward)
                for e in r.request_events if e.kind == "finished"}
    return {c["block_id"] for c in cells if any(o in finished for o in c["owners"])}


def _cell_html(cell: dict, table_pos: int | None, selected: bool, mark: str | None,
               slots: dict[int, tuple[str, str]] | None = None, block_size: int = 0,
               held: bool = False) -> str:
    kind = cell["state"]
    if kind in ("used", "shared"):
        background = request_color(cell["owners"][0])
        label = f"×{cell['ref_count']}" if kind == "shared" else html.escape(cell_name(cell["owners"][0]))
    else:
        background = STATE_COLORS[kind]
        label = "" if kind == "never used" else f"#{cell['evict_rank']}"
    head = f"{cell['block_id']}" if table_pos is None else f"{cell['block_id']} [{table_pos}]"
    border = "3px solid #000" if selected else f"3px solid {STATE_COLORS['preempted']}" if mark else \
        "3px dotted #000" if held else (
        "2px solid #222" if table_pos is not None else
        "2px double #333" if kind == "shared" else "1px dashed #bbb" if kind == "never used" else "1px solid #999"
    )
    title = f"block {cell['block_id']}: {kind}, ref_count {cell['ref_count']}, {cell['num_tokens']} tokens"
    if cell["owners"]:
        title += f", owners {', '.join(cell['owners'])}"
    if cell["hash"]:
        title += f", hash {cell['hash'][:16]}"
    if cell["evict_rank"] is not None:
        title += f", eviction order {cell['evict_rank']}"
    if mark:
        title += f"; {mark}"
    if held:
        title += "; held for a peer's KV transfer (its request finished; the consumer has not read it yet)"
    strip = ""
    if slots:
        fates = [f"slot {i}: {rid}'s {fate} draft" for i, (rid, fate) in sorted(slots.items())]
        title += "; this step's drafts: " + ", ".join(fates)
        strip = f'<br><span class="wb-slots" style="background:#fff;padding:0 1px">{slot_strip(slots, block_size)}</span>'
    return (
        f'<div class="wb-block" data-block="{cell["block_id"]}" title="{html.escape(title)}" '
        f'style="background:{background};color:{text_color(background)};border:{border};'
        f'width:60px;height:{43 if slots else 30}px;box-sizing:border-box;font:10px/13px monospace;'
        f'text-align:center;overflow:hidden">{head}<br>{label}{strip}</div>'
    )


class BlockMap(widgets.VBox):
    """``BlockMap(engine | history | run_result, step=None)``: the pool after ``step`` (None:
    the latest step; before any, an engine's pool as it is); ``during_forward=True``: as the
    step's forward pass saw it, before the requests it finished released their blocks (a
    beam search's one-token requests, which share their prefix's blocks only while the step
    runs). ``cells`` (one dict per block, see :func:`block_cells`) and
    ``summary`` (blocks per state) are what the grid shows; ``select_block(i)`` and
    ``select_request(rid)`` drive the detail pane and the block-table highlight; ``held``: the
    blocks held for a peer's KV transfer (:func:`held_blocks`), drawn with a dotted outline."""

    cells = traitlets.List()
    summary = traitlets.Dict()
    step = traitlets.Int(allow_none=True, default_value=None)
    selected_block = traitlets.Int(allow_none=True, default_value=None)
    selected_request = traitlets.Unicode("")
    marked = traitlets.Dict()  # block id -> note (e.g. "lost by r3"), drawn with a red outline
    #: block id -> {slot: (request id, fate)}: the slots the step's drafts wrote (the player
    #: sets it from :func:`~workbench.viz.spec_decode.draft_slots`), drawn as a strip of marks
    slots = traitlets.Dict()

    def __init__(self, source, step: int | None = None, *, max_cells: int = 1024, tokenizer=None,
                 during_forward: bool = False):
        self.source = ViewSource(source, tokenizer)
        self.max_cells = max_cells
        self.during_forward = during_forward
        self._state = None
        self.title = widgets.HTML()
        self.grid = widgets.HTML()
        self.legend = widgets.HTML()
        self.details = widgets.HTML()
        self.block_picker = widgets.BoundedIntText(
            value=0, min=0, max=0, description="block id", layout=widgets.Layout(width="170px")
        )
        self.request_picker = widgets.Dropdown(
            options=[("(none)", "")], description="request", layout=widgets.Layout(width="230px")
        )
        self.block_picker.observe(lambda change: self.select_block(change["new"]), "value")
        self.request_picker.observe(lambda change: self.select_request(change["new"]), "value")
        super().__init__(
            [self.title, widgets.HBox([self.block_picker, self.request_picker]), self.grid,
             self.legend, self.details]
        )
        self.show(step)

    # ------------------------------------------------------------ updates
    def show(self, step: int | None = None) -> None:
        """Draw the pool after ``step`` (None: the latest recorded step)."""
        has_state = step is not None or self.source.engine is not None or len(self.source.history)
        state = self.source.kv_state(step, during_forward=self.during_forward) if has_state else None
        self.step = step if step is not None else self.source.last_step
        self._state = state
        if state is None:
            self.cells, self.summary, self.held = [], {}, set()
            self.title.value = "<b>KV blocks</b>: no steps recorded yet"
            self.grid.value = self.legend.value = self.details.value = ""
            return
        assign_colors(e.request_id for r in self.source.records() for e in r.request_events
                      if e.kind == "arrived")
        self.cells = block_cells(state)
        self.held = held_blocks(self.cells, self.source.records(), self.step, during_forward=self.during_forward)
        counts = {kind: 0 for kind in BLOCK_STATES}
        for cell in self.cells:
            counts[cell["state"]] += 1
        self.summary = counts
        self.block_picker.max = state.num_blocks - 1
        owners = self._owners()
        adapters = request_adapters(self.source.records())
        options = [("(none)", "")] + [(request_label(o, adapters), o) for o in owners]
        if self.selected_request and self.selected_request not in owners:
            options.append((f"{self.selected_request} (no blocks)", self.selected_request))
        with self.request_picker.hold_trait_notifications():
            self.request_picker.options = options
            self.request_picker.value = self.selected_request
        self._draw()

    def refresh(self) -> None:
        """Redraw: the same step if it is an older recorded one, else the latest."""
        steps = self.source.steps
        self.show(self.step if self.step in steps[:-1] else None)

    def select_block(self, block_id: int | None) -> None:
        self.selected_block = block_id
        self._draw()

    def select_request(self, request_id: str) -> None:
        self.selected_request = request_id or ""
        if self.request_picker.value != self.selected_request and any(
            v == self.selected_request for _, v in self.request_picker.options
        ):
            self.request_picker.value = self.selected_request
        self._draw()

    def block_table(self, request_id: str) -> list[int]:
        """The request's block table in the state shown."""
        return list(self._state.block_table(request_id)) if self._state is not None else []

    # ------------------------------------------------------------ drawing
    def _visible(self) -> int:
        """Cells drawn: up to the highest block ever used (at least one row), capped."""
        touched = [c["block_id"] for c in self.cells if c["state"] != "never used"]
        last = max(touched) + 1 if touched else 0
        return min(len(self.cells), self.max_cells, max(last, 16))

    def _owners(self) -> list[str]:
        """The owners of blocks shown, in the order their colours were handed out."""
        owners = {o for cell in self.cells for o in cell["owners"]}
        return sorted(owners, key=lambda o: (color_rank(o), o))

    def _draw(self) -> None:
        if self._state is None:
            return
        state = self._state
        table = {b: i for i, b in enumerate(self.block_table(self.selected_request))} \
            if self.selected_request else {}
        shown = self._visible()
        cells = "".join(
            _cell_html(c, table.get(c["block_id"]), c["block_id"] == self.selected_block,
                       self.marked.get(c["block_id"]), self.slots.get(c["block_id"]), state.block_size,
                       c["block_id"] in self.held)
            for c in self.cells[:shown]
        )
        hidden = len(self.cells) - shown
        tail = ""
        if hidden:
            untouched = sum(1 for c in self.cells[shown:] if c["state"] == "never used")
            tail = (f"<div>blocks {shown}..{len(self.cells) - 1} not drawn: "
                    f"{untouched} of those {hidden} never used</div>")
        self.grid.value = (
            '<div style="display:flex;flex-wrap:wrap;gap:2px;max-width:900px">' + cells + "</div>" + tail
        )
        counts = ", ".join(f"{self.summary[k]} {k}" for k in BLOCK_STATES)
        step = "before the first step" if self.step is None else (
            f"during step {self.step}'s forward" if self.during_forward else f"after step {self.step}")
        self.title.value = (
            f"<b>KV blocks</b> ({step}): {state.num_blocks} blocks × "
            f"{state.block_size} tokens, {state.num_free_blocks} free; {counts}"
        )
        self.legend.value = self._legend_html()
        self.details.value = self._details_html(table)

    def _legend_html(self) -> str:
        chip = ('<span style="background:{};color:{};border:1px solid #999;padding:0 4px;'
                'margin-right:4px;font:11px monospace">{}</span>')
        owners = self._owners()
        parts = [chip.format(request_color(o), text_color(request_color(o)), html.escape(o)) for o in owners]
        for kind in ("cached", "free", "never used"):
            parts.append(chip.format(STATE_COLORS[kind], "#000", kind))
        return (
            "<div>" + "".join(parts) + "<br><small>cell: block id, then the owner (used; a long name is elided in the middle "
            "with …, the whole name shows on hover), ×ref_count "
            "(shared, double border), #n = n-th in the eviction order (free/cached), id [i] = position "
            "in the selected request's block table; red outline: blocks a preemption released "
            "in this step (red marks preemption in every view)"
            + ("; dotted outline: blocks held for a peer's KV transfer (their request finished, the "
               "consumer has not read them yet)" if self.held else "")
            + ("; slot strip: this step's drafts, one character per slot (✓ accepted, ✕ rejected: "
               "the slot is written again by the next step, a block of only rejected drafts is freed; "
               "· no draft)" if self.slots else "") + "</small></div>"
        )

    def _details_html(self, table: dict[int, int]) -> str:
        lines = []
        if self.selected_request:
            ids = self.block_table(self.selected_request)
            lines.append(f"<b>{html.escape(self.selected_request)}</b> block table: {ids or 'no blocks'}")
        if self.selected_block is not None and 0 <= self.selected_block < len(self.cells):
            cell = self.cells[self.selected_block]
            block = self._state.blocks[self.selected_block]
            text = self.source.decode(block.token_ids) if block.token_ids else ""
            lines.append(
                f"<b>block {cell['block_id']}</b>: {cell['state']}, ref_count {cell['ref_count']}, "
                f"owners {cell['owners'] or 'none'}, hash {cell['hash'][:16] + '…' if cell['hash'] else 'none'}"
                + (f", eviction order #{cell['evict_rank']}" if cell["evict_rank"] else "")
                + f"<br>{cell['num_tokens']} tokens: <code>{html.escape(repr(text))}</code>"
            )
        return "<div>" + "<br>".join(lines) + "</div>"

    def __repr__(self) -> str:
        step = "no step" if self.step is None else f"step={self.step}"
        counts = ", ".join(f"{k}={v}" for k, v in self.summary.items())
        return f"BlockMap({step}, {counts})"

    def _repr_html_(self) -> str:
        return self.title.value + self.grid.value + self.legend.value
