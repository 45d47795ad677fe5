"""The cluster timeline: one lane per replica, each request a bar in its colour.

A request's bar runs from its arrival to its finish on the replica that served it: a grey
part while it waited to be scheduled, its colour from then to its first token, and a paler
part while it decoded. Requests that overlap on a replica stack in the lane (first free
row). Seconds on the wall clock, steps on the step clock, read from
``ClusterResult.requests``, so a simulated and a real cluster draw alike.
"""

from __future__ import annotations

import math

import ipywidgets as widgets
import traitlets
from matplotlib.patches import Patch

from workbench.viz.colors import STATE_COLORS, assign_colors, request_color
from workbench.viz.figures import figure_png, new_figure, png_img

LANE = 0.85  # of a lane's height, the rest is the gap between replicas


def lane_rows(result) -> list[list[dict]]:
    """Per replica, its requests as dicts (request_id, arrival, scheduled, first_token, finished,
    row, rows: the lane's stack height), in arrival order."""
    frame = result.requests
    steps = result.clock == "steps"
    lanes: list[list[dict]] = [[] for _ in result.replicas]
    for r in frame.itertuples(index=False):
        if steps:
            times = (r.arrival_step, r.first_scheduled_step, r.first_token_step, r.finished_step)
        else:
            times = (r.arrival_s, r.arrival_s + r.queue_s, r.arrival_s + r.ttft_s, r.arrival_s + r.e2e_s)
        if any(t is None or (isinstance(t, float) and math.isnan(t)) for t in times):
            continue
        arrival, scheduled, first, finished = (float(t) for t in times)
        lanes[int(r.replica)].append({"request_id": r.request_id, "arrival": arrival, "scheduled": scheduled,
                                      "first_token": first, "finished": finished})
    for lane in lanes:
        lane.sort(key=lambda b: b["arrival"])
        ends: list[float] = []
        for bar in lane:
            row = next((i for i, end in enumerate(ends) if end <= bar["arrival"]), len(ends))
            if row < len(ends):
                ends[row] = bar["finished"]
            else:
                ends.append(bar["finished"])
            bar["row"] = row
        for bar in lane:
            bar["rows"] = max(len(ends), 1)
    return lanes


def plot_cluster_timeline(result, ax=None):
    """Draw ``result`` (a ClusterResult) on ``ax`` (None: a new figure of its own); returns the Axes."""
    if ax is None:
        ax = new_figure(9, 0.9 + 0.7 * len(result.replicas)).add_subplot()
    lanes = lane_rows(result)
    assign_colors(d["request_id"] for d in result.decision_rows)
    for index, lane in enumerate(lanes):
        for bar in lane:
            height = LANE / bar["rows"]
            y = index - LANE / 2 + bar["row"] * height
            colour = request_color(bar["request_id"])
            parts = ((bar["arrival"], bar["scheduled"], STATE_COLORS["waiting"], 1.0),
                     (bar["scheduled"], bar["first_token"], colour, 1.0),
                     (bar["first_token"], bar["finished"], colour, 0.45))
            for start, end, face, alpha in parts:
                if end > start:
                    ax.broken_barh([(start, end - start)], (y, height * 0.9), facecolors=face, alpha=alpha,
                                   linewidth=0)
    ax.set_yticks(range(len(lanes)), [f"replica {i} ({len(lane)})" for i, lane in enumerate(lanes)])
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlabel("step" if result.clock == "steps" else "seconds (each replica's clock)")
    ax.set_title(f"{result.router}: {len(result.requests)} requests on {len(lanes)} replicas")
    ax.legend(handles=[Patch(color=STATE_COLORS["waiting"], label="waiting"),
                       Patch(color="0.3", label="to first token"), Patch(color="0.3", alpha=0.45, label="decoding")],
              loc="upper right", fontsize="small")
    return ax


class ClusterTimeline(widgets.VBox):
    """The cluster timeline of a ClusterResult as a widget; ``lanes`` holds, per replica, the
    request ids it draws (in arrival order)."""

    lanes = traitlets.List()

    def __init__(self, result) -> None:
        self.figure = new_figure(9, 0.9 + 0.7 * len(result.replicas))
        plot_cluster_timeline(result, self.figure.add_subplot())
        self.image = widgets.Image(value=figure_png(self.figure), format="png")
        super().__init__([self.image])
        self.lanes = [[b["request_id"] for b in lane] for lane in lane_rows(result)]

    def _repr_html_(self) -> str:
        return png_img(self.image.value)
