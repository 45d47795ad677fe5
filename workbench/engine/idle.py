"""Waiting for work without letting torch's CPU worker threads fall asleep.

Between two parallel regions, each worker thread of torch's intra-op pool (OpenMP) spins
briefly and then parks. On a virtual machine a parked thread's vCPU halts, and waking it can
take the host several milliseconds: on the project's 2-vCPU machine, the first step after the
engine sat idle for 100 ms or more took about 12 ms longer on two steps in three (a 3 ms
prefill became 15 ms, the whole of a lone request's time to first token), while after 30 ms
or less it took no longer than any step.

So an engine that waits for requests on a CPU with more than one thread waits in ticks of
:data:`TICK_S` and on each tick runs one tiny operation that every worker thread takes part
in (an in-place add over ``GRAIN * threads`` floats, ~4 us). The threads never park, and the
first step after the wait costs what any step costs. The price: between two pokes a worker
spins instead of parking, so keeping warm costs about one core while it lasts (measured here:
100% of a core with 5 ms ticks; 39% with 20 ms ticks, which left most of the delays). So it
lasts ``keep_warm_s`` seconds after the last step (the engine config's, 10 s by default), then
lets the threads park: a server quiet for longer pays the wake-up once. Measure it on a
machine with ``python -m workbench.engine.idle``. A simulated device computes nothing: its
waiter is off and imports no torch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from workbench.worker.device import SimulatedDevice

if TYPE_CHECKING:
    import torch

#: Seconds between two pokes while warm (a 5 ms tick removed every wake-up penalty measured;
#: 10 ms left some, 20 ms most).
TICK_S = 0.005
#: torch splits an element-wise op across threads in chunks of at least this many elements.
GRAIN = 32768


class IdleWaiter:
    """``sleep(seconds)`` / ``timeout()`` + ``poke()``: idle waiting that keeps the pool warm.

    Invariant: it pokes only while ``active`` (a CPU device, more than one intra-op thread,
    ``keep_warm_s > 0``) and within ``keep_warm_s`` of the last ``mark_busy()``.
    """

    def __init__(self, device: torch.device | SimulatedDevice, keep_warm_s: float) -> None:
        if not keep_warm_s >= 0:
            raise ValueError(f"keep_warm_s must be >= 0, got {keep_warm_s!r}.")
        self.keep_warm_s = float(keep_warm_s)
        self.active = False
        self._buffer = None
        if not isinstance(device, SimulatedDevice):
            import torch

            threads = torch.get_num_threads()
            self.active = torch.device(device).type == "cpu" and threads > 1 and keep_warm_s > 0
            self._buffer = torch.zeros(GRAIN * threads) if self.active else None
        self._last_busy = time.monotonic()
        self.pokes = 0

    def mark_busy(self) -> None:
        """The engine just ran a step: keep the pool warm from now on."""
        self._last_busy = time.monotonic()

    def warm(self) -> bool:
        """True while idle waits should poke the pool."""
        return self.active and time.monotonic() - self._last_busy <= self.keep_warm_s

    def poke(self) -> None:
        """One parallel region that every intra-op thread takes part in."""
        self._buffer.add_(1.0)
        self.pokes += 1

    def timeout(self) -> float | None:
        """How long a condition wait may block before the next poke; None: as long as it likes."""
        return TICK_S if self.warm() else None

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of wall time, poking every :data:`TICK_S` while warm."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if not self.warm():
                time.sleep(left)
                return
            time.sleep(min(left, TICK_S))
            self.poke()

    def __repr__(self) -> str:
        state = "warm" if self.warm() else ("parked" if self.active else "off")
        return f"IdleWaiter({state}, keep_warm_s={self.keep_warm_s:g}, tick={TICK_S * 1e3:g} ms, pokes={self.pokes})"


def measure(gaps=(0.01, 0.03, 0.1, 0.3, 1.0), repeats: int = 10, keep_warm_s: float = 60.0) -> None:
    """Print how much longer a fixed matmul burst takes after an idle ``gap`` than back to back,
    with plain ``time.sleep`` and with :class:`IdleWaiter` (median and all repeats, ms)."""
    import numpy as np
    import torch

    a, w = torch.randn(200, 192), torch.randn(192, 512)

    def burst() -> float:
        t = time.perf_counter()
        for _ in range(40):
            torch.matmul(a, w)
        return time.perf_counter() - t

    for _ in range(50):
        burst()
    base = float(np.median([burst() for _ in range(50)]))
    waiter = IdleWaiter(torch.device("cpu"), keep_warm_s)
    print(f"{torch.get_num_threads()} threads; burst {base * 1e3:.2f} ms back to back; extra ms after a gap:")
    for name, wait in (("time.sleep", time.sleep), ("IdleWaiter", waiter.sleep)):
        for gap in gaps:
            extra = []
            for _ in range(repeats):
                wait(gap)
                extra.append((burst() - base) * 1e3)
                waiter.mark_busy()
            print(f"  {name:<11} gap {gap * 1e3:6.0f} ms: median {np.median(extra):6.2f}  "
                  f"max {max(extra):6.2f}  ({sum(e > 2 for e in extra)}/{repeats} over 2 ms)")


if __name__ == "__main__":
    measure()
