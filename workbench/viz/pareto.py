"""The Pareto front of a sweep: the configurations no other one beats on both axes.

``pareto_front(frame)`` returns the rows of a :func:`workbench.lab.sweep.sweep` DataFrame (any
DataFrame with the two columns) that are not dominated: no other row is at least as good on
both ``x`` and ``y`` and strictly better on one. By default a lower ``x`` (p99 time to first
token) and a higher ``y`` (throughput) are better. Rows whose ``x`` or ``y`` is NaN (failed
configurations) take no part. ``pareto_figure(frame)`` draws every configuration and
highlights and labels the front; both are deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from matplotlib.figure import Figure

from workbench.viz.figures import new_figure

BETTER = ("lower", "higher")


def pareto_front(
    frame,
    x: str = "ttft_s_p99",
    y: str = "throughput_tok_s",
    *,
    x_better: str = "lower",
    y_better: str = "higher",
):
    """The non-dominated rows of ``frame`` (original index kept), sorted by ``x`` from best
    to worst. Rows with the same (x, y) on the front are all kept. O(n log n)."""
    for name, column in (("x", x), ("y", y)):
        if column not in frame.columns:
            raise ValueError(f"{name}={column!r} is not a column of the frame; columns: {list(frame.columns)}.")
    for name, better in (("x_better", x_better), ("y_better", y_better)):
        if better not in BETTER:
            raise ValueError(f"{name} must be one of {BETTER}, got {better!r}.")
    xs = frame[x].astype("float64")
    ys = frame[y].astype("float64")
    # Scores where lower is better on both axes.
    sx = xs if x_better == "lower" else -xs
    sy = ys if y_better == "lower" else -ys
    points = sorted(
        (float(a), float(b), pos) for pos, (a, b) in enumerate(zip(sx, sy)) if not (math.isnan(a) or math.isnan(b))
    )
    front: list[int] = []
    best_y = math.inf  # best y score among points with a strictly better x score
    i = 0
    while i < len(points):
        j = i
        while j < len(points) and points[j][0] == points[i][0]:
            j += 1
        group_best = points[i][1]  # points with this x, best y first
        if group_best < best_y:
            front.extend(pos for _, b, pos in points[i:j] if b == group_best)
            best_y = group_best
        i = j
    return frame.iloc[front]


def pareto_figure(
    frame,
    x: str = "ttft_s_p99",
    y: str = "throughput_tok_s",
    *,
    x_better: str = "lower",
    y_better: str = "higher",
    label_columns: Sequence[str] | None = None,
    figsize: tuple[float, float] = (6.4, 4.2),
) -> Figure:
    """Every configuration of ``frame`` as a grey point, the Pareto front (see
    :func:`pareto_front`) as red points joined in ``x`` order, each labelled with its values
    of ``label_columns`` -- by default the sweep's config columns (``frame.attrs``) that take
    more than one value. A matplotlib ``Figure`` outside pyplot."""
    front = pareto_front(frame, x, y, x_better=x_better, y_better=y_better)
    if label_columns is None:
        columns = frame.attrs.get("config_columns", [])
        label_columns = [c for c in columns if c in frame.columns and frame[c].astype(str).nunique() > 1]
    missing = [c for c in label_columns if c not in frame.columns]
    if missing:
        raise ValueError(f"label_columns {missing} are not columns of the frame.")
    valid = frame[frame[x].notna() & frame[y].notna()]
    figure = new_figure(*figsize)
    ax = figure.add_subplot()
    ax.scatter(valid[x], valid[y], color="#9e9e9e", s=22, label=f"configs ({len(valid)})", zorder=2)
    ax.plot(front[x], front[y], color="#d32f2f", marker="o", markersize=6, linewidth=1.2,
            label=f"Pareto front ({len(front)})", zorder=3)
    x_mid = sum(ax.get_xlim()) / 2
    for _, row in front.iterrows():
        text = ", ".join(f"{c}={_label(row[c])}" for c in label_columns)
        if text:  # labels of the right half extend to the left, to stay inside the axes
            right = row[x] > x_mid
            ax.annotate(text, (row[x], row[y]), xytext=(-4 if right else 4, 4), textcoords="offset points",
                        ha="right" if right else "left", fontsize=7)
    ax.set_xlabel(f"{x} ({x_better} is better)")
    ax.set_ylabel(f"{y} ({y_better} is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    failed = len(frame) - len(valid)
    ax.set_title(f"{len(front)} of {len(valid)} configs on the Pareto front"
                 + (f" ({failed} without {x} / {y})" if failed else ""), fontsize=10)
    return figure


def _label(value) -> str:
    """A config value as a short label: a policy object by its name, floats compactly."""
    if isinstance(value, float):
        return f"{value:g}"
    return str(getattr(value, "name", value))
