"""Live updates for views: an ``engine.on_step`` hook that never slows the engine.

The hook only marks the view stale (O(1), on whatever thread steps the engine: a cell, a
widget callback, ``%llm serve``'s engine thread); a timer thread redraws at most once per
``interval`` seconds, after the steps of that interval -- and waits longer after a slow
redraw, so that redrawing takes at most ``max_share`` of the time (it holds the GIL the
engine's Python code needs). A redraw that raises is logged and the next step schedules
another.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class LiveUpdater:
    """``LiveUpdater(engine, redraw, interval=0.5, max_share=0.1)`` calls ``redraw()`` after
    steps, throttled.

    ``close()`` removes the hook (a view that is gone stops costing anything).
    """

    def __init__(self, engine, redraw: Callable[[], None], interval: float = 0.5,
                 max_share: float = 0.1) -> None:
        self.engine = engine
        self.redraw = redraw
        self.interval = interval
        self.max_share = max_share
        self.num_redraws = 0
        self._last_cost = 0.0  # seconds the previous redraw took
        self._drawing: threading.Thread | None = None  # the timer thread while it redraws
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.paused = False  # True while the view itself steps the engine and redraws after
        engine.on_step.append(self._on_step)

    def _on_step(self, record) -> None:
        if self.paused:
            return
        with self._lock:
            if self._timer is None:
                delay = max(self.interval, self._last_cost / self.max_share)
                self._timer = threading.Timer(delay, self._fire)
                self._timer.daemon = True
                self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            self._timer = None
            self._drawing = threading.current_thread()
        start = time.perf_counter()
        try:
            self.redraw()
            self.num_redraws += 1
        except Exception:  # a view must never take the engine down
            logger.exception("live view redraw failed")
        self._last_cost = time.perf_counter() - start
        self._drawing = None

    def close(self) -> None:
        """Remove the hook, cancel a pending redraw and wait for one in progress."""
        if self._on_step in self.engine.on_step:
            self.engine.on_step.remove(self._on_step)
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            drawing = self._drawing
        if drawing is not None and drawing is not threading.current_thread():
            drawing.join(timeout=30)

    def __repr__(self) -> str:
        return f"LiveUpdater(interval={self.interval}s)"
