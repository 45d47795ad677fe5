"""SimClock: simulated seconds, advanced by the simulated runner and jumped over idle time."""

from __future__ import annotations


class SimClock:
    """A clock that only moves when told: ``clock()`` reads it, ``advance(dt)`` moves it by a
    step's predicted duration. What a driver does between steps is noted for the simulated
    runner to price in the next step (with the CostModel): ``sleep(dt)`` -- the engine sat
    idle -- jumps the clock at once and adds ``dt`` to ``idle_s`` (the next step pays the
    wake-up cost); ``input_processed(n)`` -- the driver tokenized a text prompt of ``n`` tokens --
    queues ``n`` in ``text_prompt_tokens``. Never goes backwards. Picklable."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)
        self.idle_s = 0.0
        self.text_prompt_tokens: list[int] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"a simulated clock cannot go back: advance({seconds!r}).")
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)
        self.idle_s += seconds

    def input_processed(self, num_tokens: int) -> None:
        self.text_prompt_tokens.append(num_tokens)

    def __repr__(self) -> str:
        return f"SimClock(now={self.now:.6f})"

    def _repr_html_(self) -> str:
        return f"<b>SimClock</b>: {self.now:.6f} simulated seconds"
