"""Matplotlib pictures of a run: tokens per step, KV usage and queues, the block pool.

Each function takes what it draws (a StepHistory, a KV cache or KVState) and an ``ax``, and
returns the Axes, so a notebook can compose them. The widgets always pass axes of figures they
own (:mod:`workbench.viz.figures`); ``ax=None`` is a notebook convenience that makes a pyplot
figure (main thread only). Nothing here changes engine state.
"""

from __future__ import annotations

from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from workbench.viz.block_map import block_cells
from workbench.viz.chunks import chunk_kinds, empty_batch_reason
from workbench.viz.colors import STATE_COLORS, assign_colors, request_color
from workbench.viz.encoding import CHUNK_HATCH, chunk_handles


def _axes(ax, size=(8, 3)):
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=size)
    return ax


def _records(history, last: int | None):
    records = history[:]
    return records[-last:] if last else records


def plot_step_tokens(history, ax=None, last: int = 200):
    """Tokens scheduled per step, stacked per request in the request's colour (hatched by
    chunk kind as in the timeline; empty batches shaded), against the token budget.

    The y axis is scaled to the bars; the budget is a dashed reference line drawn behind them
    when it is within twice the tallest bar, otherwise noted in the legend ("off scale").
    Only the ``last`` steps are drawn (a served engine keeps thousands).
    """
    records = _records(history, last)
    ax = _axes(ax)
    if not records:
        ax.set_title("no steps yet")
        return ax
    kinds = chunk_kinds(history[:])
    assign_colors(e.request_id for r in records for e in r.request_events)
    empty = [r.step for r in records if empty_batch_reason(r)]
    for step in empty:
        ax.axvspan(step - 0.5, step + 0.5, color=STATE_COLORS["empty batch"], alpha=0.25, linewidth=0)
    for record in records:
        bottom = 0
        for chunk in record.scheduler_output.scheduled:
            ax.bar(record.step, chunk.num_new_tokens, bottom=bottom, width=0.85,
                   color=request_color(chunk.request_id), hatch=CHUNK_HATCH[kinds[record.step, chunk.request_id]],
                   edgecolor="black", linewidth=0.3)
            bottom += chunk.num_new_tokens
    tallest = max(r.num_scheduled_tokens for r in records) or 1
    budget = records[-1].scheduler_output.token_budget
    top = tallest * 1.2
    handles = chunk_handles()
    if empty:
        handles.append(Patch(color=STATE_COLORS["empty batch"], alpha=0.25, label="empty batch"))
    if budget <= 2 * tallest:
        top = max(top, budget * 1.1)
        line = ax.axhline(budget, color="black", lw=1, ls="--", zorder=0)
        line.set_label(f"token budget ({budget})")
        handles.append(line)
    else:
        handles.append(Patch(color="none", label=f"token budget {budget} (off scale)"))
    preempted = [r for r in records if r.scheduler_output.preempted_request_ids]
    if preempted:
        handles.append(ax.scatter([r.step for r in preempted],
                                  [r.num_scheduled_tokens + tallest * 0.06 for r in preempted],
                                  marker="v", color=STATE_COLORS["preempted"], zorder=3, label="preemption"))
    ax.set_ylim(0, top)
    ax.set_xlim(records[0].step - 0.6, records[-1].step + 0.6)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("Tokens scheduled per step (colour = request)")
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize="small",
              ncols=3, frameon=False)
    return ax


def plot_kv_usage(history, ax=None, last: int | None = None):
    """KV-cache usage in % of blocks (left axis, scaled to the peak) and running / waiting
    requests (right axis)."""
    records = _records(history, last)
    ax = _axes(ax)
    if not records:
        ax.set_title("no steps yet")
        return ax
    steps = [r.step for r in records]
    ax.set_xlim(steps[0] - 0.6, steps[-1] + 0.6)
    ax.fill_between(steps, [r.kv_usage * 100 for r in records], color="0.8",
                    step="mid", label="KV usage (% of blocks)")
    peak = max(r.kv_usage for r in records) * 100
    ax.set_ylim(0, min(105, max(1.0, peak * 1.25)))  # scaled to the data: 0.1% of a big pool shows
    ax.set_ylabel("KV usage (% of blocks)")
    ax.set_xlabel("step")
    twin = ax.twinx()
    twin.step(steps, [r.num_running for r in records], where="mid", color="black", label="running")
    twin.step(steps, [r.num_waiting for r in records], where="mid", color=STATE_COLORS["waiting"], lw=2, label="waiting")
    twin.set_ylabel("requests")
    twin.set_ylim(0, max(1, max(max(r.num_running, r.num_waiting) for r in records)) * 1.15)
    twin.yaxis.set_major_locator(MaxNLocator(integer=True))
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper center", bbox_to_anchor=(0.5, -0.2),
              fontsize="small", ncols=3, frameon=False)
    ax.set_title("KV cache and queues")
    return ax


def plot_kv_blocks(kv, ax=None, columns: int = 16, max_blocks: int = 256):
    """The block pool as a grid, one cell per block: the owner's colour when in use (a shared
    block is outlined and labelled ×ref_count), blue-grey when free but still cached, light
    grey when free, white when never used. ``kv`` is a KVCacheManager (live) or a KVState.

    Blocks ``0..max_blocks-1`` are drawn (low ids are handed out first, so that is the part
    of a large pool in play); the title counts every block.
    """
    state = kv.snapshot() if hasattr(kv, "snapshot") else kv
    cells = block_cells(state)[:max_blocks]
    n = len(cells)
    rows = -(-n // columns)
    ax = _axes(ax, size=(min(12, columns * 0.5), max(1.0, rows * 0.5)))
    for cell in cells:
        r, c = divmod(cell["block_id"], columns)
        owner = cell["owners"][0] if cell["owners"] else None
        face = request_color(owner) if owner else STATE_COLORS[cell["state"]]
        shared = cell["state"] == "shared"
        ax.add_patch(Rectangle((c, rows - 1 - r), 0.95, 0.95, facecolor=face,
                               edgecolor="black" if shared else "0.6", linewidth=2 if shared else 0.5))
        label = f"{cell['block_id']}\n×{cell['ref_count']}" if shared else str(cell["block_id"])
        ax.text(c + 0.47, rows - 1 - r + 0.47, label, ha="center", va="center", fontsize=6)
    ax.set_xlim(0, columns)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    owners = list(dict.fromkeys(o for cell in cells for o in cell["owners"]))
    handles = [Patch(color=request_color(o), label=o) for o in owners[:30]]
    handles += [Patch(facecolor=STATE_COLORS[k], edgecolor="0.6", label=k) for k in ("cached", "free", "never used")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    shown = "" if n == state.num_blocks else f" (first {n} drawn)"
    ax.set_title(f"KV blocks: {state.num_free_blocks}/{state.num_blocks} free{shown}")
    return ax
