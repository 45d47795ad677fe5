"""Replica: one engine of a cluster on its own clock, and the state a router reads of it.

Every replica keeps its own seconds, so N engines stepped one after another on one machine
still give the timeline of N machines:

* a simulated replica runs on a :class:`~workbench.lab.sim.clock.SimClock` that its cost
  model advances by each step's predicted duration;
* a real replica runs on a :class:`MeasuredClock`: only the wall time spent inside its own
  steps counts (what the other replicas did meanwhile does not), and idle time jumps.

A replica's clock never goes back; an idle replica jumps to the arrival it is given.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


class MeasuredClock:
    """Seconds that pass only inside :meth:`running` steps (wall time, measured) or by
    :meth:`sleep` (a jump over idle time). Reading it inside a step gives the step's start
    plus the wall time elapsed since, so timestamps the engine takes mid-step are measured."""

    def __init__(self) -> None:
        self.now = 0.0
        self._since: float | None = None  # perf_counter() when the current step began

    def __call__(self) -> float:
        if self._since is None:
            return self.now
        return self.now + (time.perf_counter() - self._since)

    def begin(self) -> None:
        self._since = time.perf_counter()

    def end(self) -> None:
        self.now += time.perf_counter() - self._since
        self._since = None

    def sleep(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"a replica's clock cannot go back: sleep({seconds!r}).")
        self.now += seconds

    def __repr__(self) -> str:
        return f"MeasuredClock(now={self.now:.6f})"


@dataclass(frozen=True)
class ReplicaView:
    """What a router sees of one replica at an arrival (the state after its last step).

    ``num_requests``: requests it holds that have not finished (waiting + running, including
    those routed to it since its last step); ``num_waiting`` / ``num_running``: the
    scheduler's queues; ``kv_usage``: the fraction of KV blocks in use; ``engine``: the live
    engine, for a router of your own that needs more (read it, never step it).
    """

    index: int
    num_requests: int
    num_waiting: int
    num_running: int
    kv_usage: float
    num_free_blocks: int
    block_size: int
    now: float
    engine: object = None


class Replica:
    """An engine, its clock, and what it was given: ``step()`` runs one engine step and
    advances the clock; ``idle_until(t)`` jumps an idle replica's clock to ``t``."""

    def __init__(self, index: int, engine, clock, measured: bool) -> None:
        self.index, self.engine, self.clock, self.measured = index, engine, clock, measured
        self.steps = 0  # steps this replica took in the run
        #: On the step clock a replica's time is its step count (set by the cluster).
        self.on_step_clock = False
        self.prefix0 = (engine.kv_cache.prefix_cache_stats.queries, engine.kv_cache.prefix_cache_stats.hits)
        self._view: ReplicaView | None = None  # the view since the last step, add or clock jump

    @property
    def now(self) -> float:
        return self.steps if self.on_step_clock else self.clock.now

    @property
    def busy(self) -> bool:
        engine = self.engine  # a producer holding blocks steps once it knows when they were read
        return engine.has_unfinished_requests() or (
            engine.kv_connector is not None and engine.runner.next_transfer_time() is not None)

    def step(self) -> list:
        if self.measured:
            self.clock.begin()
            try:
                outputs = self.engine.step()
            finally:
                self.clock.end()
        else:
            outputs = self.engine.step()
        self.steps += 1
        self._view = None
        return outputs

    def idle_until(self, t: float) -> None:
        if t > self.clock.now:
            self.clock.sleep(t - self.clock.now)
            self._view = None

    def changed(self) -> None:
        """Something was added to the engine: the next :meth:`view` reads it afresh."""
        self._view = None

    def view(self) -> ReplicaView:
        """The replica as a router sees it; made once per change (a step, an add, a clock jump)."""
        if self._view is None:
            engine = self.engine
            scheduler, kv = engine.scheduler, engine.kv_cache
            waiting, running = len(scheduler.waiting), len(scheduler.running)
            self._view = ReplicaView(self.index, waiting + running, waiting, running, kv.usage, kv.num_free_blocks,
                                     engine.config.block_size, self.now, engine)
        return self._view
