"""Figures the views own: ``matplotlib.figure.Figure`` objects outside pyplot's registry.

A widget callback may run on a second kernel thread (JupyterLab's "Kernel Comms over
subshells") while the inline backend redraws and closes pyplot's figures on the main thread;
figures made here are never seen by pyplot, so drawing and rendering them is safe anywhere.
"""

from __future__ import annotations

import base64
import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def new_figure(width: float, height: float) -> Figure:
    """A figure of ``width`` x ``height`` inches with an Agg canvas and a constrained layout."""
    figure = Figure(figsize=(width, height), layout="constrained", dpi=100)
    FigureCanvasAgg(figure)
    return figure


def figure_png(figure: Figure, dpi: float | None = None) -> bytes:
    """The figure rendered to PNG bytes (what an ``ipywidgets.Image`` shows), at ``dpi``
    (None: the figure's own)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi or "figure")
    return buffer.getvalue()


def png_img(png: bytes) -> str:
    """An ``<img>`` tag holding PNG bytes inline (static HTML reprs of the views)."""
    return f'<img src="data:image/png;base64,{base64.b64encode(bytes(png)).decode()}">'
