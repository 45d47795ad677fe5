"""SimClock: simulated seconds, advanced by the simulated runner and jumped over idle time."""

from __future__ import annotations


class SimClock:
    """A clock that only moves when told: ``clock()`` reads it, ``advance(dt)`` moves it by a
    step's predicted duration, ``sleep(dt)`` (what a driver calls when the engine is idle)
    jumps it forward at once. Never goes backwards. Picklable."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"a simulated clock cannot go back: advance({seconds!r}).")
        self.now += seconds

    sleep = advance

    def __repr__(self) -> str:
        return f"SimClock(now={self.now:.6f})"

    def _repr_html_(self) -> str:
        return f"<b>SimClock</b>: {self.now:.6f} simulated seconds"
