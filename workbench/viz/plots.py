"""Matplotlib pictures of a run: tokens per step, KV usage and queues, the block pool.

Each function takes what it draws (a StepHistory, a KVCacheManager) and an optional ``ax``,
and returns the Axes, so a notebook can compose them. Nothing here changes engine state.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator


def _axes(ax, size=(8, 3)):
    if ax is None:
        _, ax = plt.subplots(figsize=size)
    return ax


def plot_step_tokens(history, ax=None, last: int = 200):
    """Stacked bars: prefill and decode tokens each step, against the token budget.

    Only the ``last`` steps are drawn (a served engine keeps thousands).
    """
    frame = history.to_dataframe().tail(last)
    ax = _axes(ax)
    if frame.empty:
        ax.set_title("no steps yet")
        return ax
    steps = frame.index.to_numpy()
    ax.bar(steps, frame["prefill_tokens"], label="prefill tokens", color="tab:orange", width=0.9)
    ax.bar(steps, frame["decode_tokens"], bottom=frame["prefill_tokens"], label="decode tokens",
           color="tab:blue", width=0.9)
    ax.step(steps, frame["token_budget"], where="mid", color="black", lw=1, label="token budget")
    preempted = frame.index[frame["preempted"] > 0]
    if len(preempted):
        ax.scatter(preempted, frame.loc[preempted, "num_tokens"] + 0.5, marker="v", color="red",
                   label="preemption", zorder=3)
    ax.set_ylim(0, frame["token_budget"].max() * 1.25)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens")
    ax.set_title("Tokens scheduled per step")
    ax.legend(loc="upper right", fontsize="small", ncols=2)
    return ax


def plot_kv_usage(history, ax=None):
    """KV-cache usage (left axis) and running / waiting queue lengths (right axis) per step."""
    frame = history.to_dataframe()
    ax = _axes(ax)
    if frame.empty:
        ax.set_title("no steps yet")
        return ax
    ax.fill_between(frame.index, frame["kv_usage"] * 100, color="tab:green", alpha=0.3,
                    step="mid", label="KV usage %")
    ax.set_ylim(0, 100)
    ax.set_ylabel("KV usage (%)")
    ax.set_xlabel("step")
    twin = ax.twinx()
    twin.step(frame.index, frame["running"], where="mid", color="tab:blue", label="running")
    twin.step(frame.index, frame["waiting"], where="mid", color="tab:red", label="waiting")
    twin.set_ylabel("requests")
    twin.yaxis.set_major_locator(MaxNLocator(integer=True))
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize="small",
              bbox_to_anchor=(1.12, 1))
    ax.set_title("KV cache and queues")
    return ax


def plot_kv_blocks(kv_cache, ax=None, columns: int = 16, max_blocks: int = 256):
    """The block pool as a grid: one cell per physical block, coloured by owning request.

    Free blocks are white; free blocks that still hold a cached prefix are grey (they can be
    reused by a prefix hit until evicted); a cell owned by several requests is hatched.
    Only the first ``max_blocks`` block ids are drawn (the free queue hands out low ids
    first), so a large default pool stays quick to draw.
    """
    n = min(kv_cache.num_blocks, max_blocks)
    rows = -(-n // columns)
    ax = _axes(ax, size=(min(12, columns * 0.5), max(1.0, rows * 0.5)))
    owners = sorted({o for i in range(n) for o in kv_cache.blocks[i].owners})
    palette = plt.get_cmap("tab20")
    colour = {o: palette(k % 20) for k, o in enumerate(owners)}
    for i in range(n):
        block = kv_cache.blocks[i]
        r, c = divmod(i, columns)
        if block.owners:
            face = colour[sorted(block.owners)[0]]
        else:
            face = "0.85" if block.block_hash is not None else "white"
        ax.add_patch(plt.Rectangle((c, rows - 1 - r), 0.95, 0.95, facecolor=face, edgecolor="0.4",
                                   hatch="//" if len(block.owners) > 1 else None))
        ax.text(c + 0.47, rows - 1 - r + 0.47, str(i), ha="center", va="center", fontsize=6)
    ax.set_xlim(0, columns)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[o]) for o in owners]
    handles += [plt.Rectangle((0, 0), 1, 1, facecolor="0.85", edgecolor="0.4")]
    ax.legend(handles, owners + ["cached, free"], loc="upper left", bbox_to_anchor=(1.01, 1),
              fontsize="small")
    shown = "" if n == kv_cache.num_blocks else f" (first {n} drawn)"
    ax.set_title(f"KV blocks: {kv_cache.num_free_blocks}/{kv_cache.num_blocks} free{shown}")
    return ax

