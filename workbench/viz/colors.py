"""One colour per request, the same in every view and every run of a workload.

The colour depends only on the request id: ids ending in a number (``r7``, ``req-12``,
``0_r3``) step a golden-ratio walk around the hue circle, so consecutive requests get far-apart
hues; other ids are hashed (sha1, never Python's salted ``hash``). Lightness cycles through
three levels so that 100+ requests stay distinguishable in neighbouring rows.
"""

from __future__ import annotations

import colorsys
import hashlib
import re

_GOLDEN = 0.618033988749895
_LEVELS = ((0.62, 0.45), (0.80, 0.38), (0.55, 0.58))  # (saturation, lightness)
_TRAILING_NUMBER = re.compile(r"(\d+)$")

#: States of a KV block and of a request's span, with their fixed colours (not request colours).
STATE_COLORS = {
    "never used": "#ffffff",
    "free": "#e8e8e8",
    "cached": "#b9c7d6",  # free but still holds a prefix hash: evictable, reusable by a hit
    "waiting": "#d9d9d9",
    "preempted": "#d62728",
    "selected": "#000000",
}


def request_index(request_id: str) -> int:
    """A stable integer for a request id: its trailing number, else a sha1 digest prefix."""
    match = _TRAILING_NUMBER.search(request_id)
    if match:
        return int(match.group(1))
    return int.from_bytes(hashlib.sha1(request_id.encode()).digest()[:4], "big")


def request_color(request_id: str) -> str:
    """The request's colour as ``#rrggbb``."""
    k = request_index(request_id)
    saturation, lightness = _LEVELS[k % len(_LEVELS)]
    r, g, b = colorsys.hls_to_rgb((k * _GOLDEN) % 1.0, lightness, saturation)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def text_color(background: str) -> str:
    """Black or white, whichever reads better on ``background`` (``#rrggbb``)."""
    r, g, b = (int(background[i : i + 2], 16) for i in (1, 3, 5))
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#ffffff"
