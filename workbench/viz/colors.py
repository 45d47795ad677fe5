"""One colour per request, assigned once per kernel in order of first appearance.

Invariants: distinct request ids get distinct colours; a request keeps its colour in every
view and every run of the kernel (a comparison's configs share the workload's ids, so their
panels agree); no request colour is a state colour. The first 20 come from a qualitative
palette (no red, no grey: red marks preemption, greys mark block and queue states); later
ones walk the hue circle by the golden ratio outside the red band, three lightness levels
deep. Past 20 colours alone stop being easy to tell apart, so every view also prints the
request's name beside its colour (row labels, chips, block cells): the second encoding.
"""

from __future__ import annotations

import colorsys
import html
import itertools

#: Request colours, in the order they are handed out.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
    "#393b79", "#ffbb78", "#98df8a", "#7b4173", "#c49c94", "#f7b6d2", "#637939", "#9edae5",
    "#00a087", "#c5b0d5", "#6b6ecf", "#e7ba52",
)
_GOLDEN = 0.618033988749895
_LEVELS = ((0.65, 0.45), (0.80, 0.33), (0.55, 0.62))  # (saturation, lightness)
_RED_BAND = 0.06  # hues within this of pure red are left to "preempted"

#: States of a KV block, a request's span and a step, in colours no request gets.
STATE_COLORS = {
    "never used": "#ffffff",
    "free": "#e8e8e8",
    "cached": "#b9c7d6",  # free but still holds a prefix hash: evictable, reusable by a hit
    "waiting": "#a8a8a8",
    "preempted": "#d62728",  # the preemption and all it causes: lost blocks, recompute chunks
    "empty batch": "#505050",
    "selected": "#000000",
}

#: A speculative draft's fate (:mod:`workbench.viz.spec_decode`): colour and mark character
#: (the second encoding). No red, and none is a request colour.
SPEC_COLORS = {"accepted": "#2e7d32", "rejected": "#b26a00", "bonus": "#1565c0", "recovered": "#6a1b9a"}
SPEC_MARKS = {"accepted": "✓", "rejected": "✕", "bonus": "+", "recovered": "↳"}

_assigned: dict[str, str] = {}
_generated = itertools.count()


def _next_generated() -> str:
    while True:
        k = next(_generated)
        hue = _RED_BAND + (k * _GOLDEN) % 1.0 * (1 - 2 * _RED_BAND)
        saturation, lightness = _LEVELS[k % len(_LEVELS)]
        r, g, b = colorsys.hls_to_rgb(hue, lightness, saturation)
        colour = f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"
        if colour not in _assigned.values() and colour not in STATE_COLORS.values():
            return colour


def request_color(request_id: str) -> str:
    """The request's colour as ``#rrggbb`` (assigned on first sight, kept for the kernel)."""
    colour = _assigned.get(request_id)
    if colour is None:
        n = len(_assigned)
        colour = PALETTE[n] if n < len(PALETTE) else _next_generated()
        _assigned[request_id] = colour
    return colour


def color_rank(request_id: str) -> int:
    """The request's place in the order colours were handed out (assigning one if new)."""
    request_color(request_id)
    return list(_assigned).index(request_id)


def assign_colors(request_ids) -> None:
    """Hand out colours in this order (a view passes its requests in arrival order before
    drawing, so first appearance means first arrival, not first drawn)."""
    for request_id in request_ids:
        request_color(request_id)


def text_color(background: str) -> str:
    """Black or white, whichever reads better on ``background`` (``#rrggbb``)."""
    r, g, b = (int(background[i : i + 2], 16) for i in (1, 3, 5))
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#ffffff"


def request_chip(request_id: str) -> str:
    """The request's name on its colour, as HTML (chips in tables and queues)."""
    colour = request_color(request_id)
    return (f'<span style="background:{colour};color:{text_color(colour)};padding:0 4px;'
            f'font:11px monospace">{html.escape(request_id)}</span>')
