"""Live updates for views: an ``engine.on_step`` hook that never slows the engine.

The hook only marks the view stale (O(1), on whatever thread steps the engine: a cell, a
widget callback, ``%llm serve``'s engine thread); a timer thread redraws at most once per
``interval`` seconds, after the steps of that interval. A redraw that raises is logged and
the next step schedules another.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class LiveUpdater:
    """``LiveUpdater(engine, redraw, interval=0.5)`` calls ``redraw()`` after steps, throttled.

    ``close()`` removes the hook (a view that is gone stops costing anything).
    """

    def __init__(self, engine, redraw: Callable[[], None], interval: float = 0.5) -> None:
        self.engine = engine
        self.redraw = redraw
        self.interval = interval
        self.num_redraws = 0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.paused = False  # True while the view itself steps the engine and redraws after
        engine.on_step.append(self._on_step)

    def _on_step(self, record) -> None:
        if self.paused:
            return
        with self._lock:
            if self._timer is None:
                self._timer = threading.Timer(self.interval, self._fire)
                self._timer.daemon = True
                self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            self._timer = None
        try:
            self.redraw()
            self.num_redraws += 1
        except Exception:  # a view must never take the engine down
            logger.exception("live view redraw failed")

    def close(self) -> None:
        if self._on_step in self.engine.on_step:
            self.engine.on_step.remove(self._on_step)
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def __repr__(self) -> str:
        return f"LiveUpdater(interval={self.interval}s)"
