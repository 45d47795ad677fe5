"""SimClock: simulated seconds, advanced by the simulated runner and jumped over idle time."""

from __future__ import annotations


class SimClock:
    """A clock that only moves when told: ``clock()`` reads it, ``advance(dt)`` moves it by a
    step's predicted duration, ``sleep(dt)`` (what a driver calls when the engine is idle)
    jumps it forward at once and marks the engine as idle until its next step
    (``after_idle``, which the simulated runner prices with ``CostModel.wake_s``). Never goes
    backwards. Picklable."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)
        self.after_idle = False

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"a simulated clock cannot go back: advance({seconds!r}).")
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)
        self.after_idle = True

    def __repr__(self) -> str:
        return f"SimClock(now={self.now:.6f})"

    def _repr_html_(self) -> str:
        return f"<b>SimClock</b>: {self.now:.6f} simulated seconds"
