"""How each chunk kind is drawn: one encoding per event in every view (timeline, step plot,
comparison timelines). Colour is the request's; the hatch says what the chunk did."""

from __future__ import annotations

from matplotlib.patches import Patch

#: Hatch per chunk kind: a prompt chunk computed for the first time, one computed again
#: after a preemption dropped its K/V, a decode token.
CHUNK_HATCH = {"prefill": "////", "recompute": "xx", "decode": None}
CHUNK_LABELS = {"prefill": "prefill chunk", "recompute": "recompute chunk (after a preemption)",
                "decode": "decode"}


def chunk_handles() -> list[Patch]:
    """Legend entries for the chunk kinds, in a neutral grey (colour = the request)."""
    return [Patch(facecolor="0.7", hatch=CHUNK_HATCH[kind], edgecolor="black", linewidth=0.3,
                  label=CHUNK_LABELS[kind]) for kind in CHUNK_HATCH]
