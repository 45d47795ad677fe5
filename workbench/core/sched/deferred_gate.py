"""The admission gate of vLLM issue #53130, as a policy: deferred requests hold seats.

vLLM's report: once running plus *deferred* requests (waiting for a grammar or for remote KV)
reach ``max_num_seqs``, the scheduler admits nothing more -- with KV blocks free -- until a
restart. The count of deferred requests is kept beside the queue and a deferred request that
ends without ever running (its grammar failed, it was aborted) is never taken off it, so the
seats it holds leak.

DeferredGatePolicy reproduces that gate on top of FCFS order: a request that arrives deferred
(WAITING_FOR_FSM) joins its count and leaves it when the policy sees it ready (no longer
WAITING_FOR_FSM); one that ended first never leaves it.
``seats_held`` is that count, which the scheduler adds to the running requests before admitting
anyone. The fix is the built-in gate (``seats_held`` = 0: only running requests hold seats):
``run.fork_at(step, policy="fcfs")``.
"""

from __future__ import annotations

from workbench.core.sched.policies import SchedulingPolicy
from workbench.request import Request, RequestStatus


class DeferredGatePolicy(SchedulingPolicy):
    """FCFS order; admission counts the deferred requests it saw arrive (see the module
    docstring). Invariant: ``deferred`` holds every request that arrived deferred and has not
    been seen ready since, ended ones included (the leak)."""

    name = "deferred_gate"

    def __init__(self) -> None:
        self.deferred: set[str] = set()

    def sort_key(self, request: Request) -> tuple[float]:
        """Arrival order (what FCFS serves), and the arrival seen: a deferred one is counted."""
        if request.status is RequestStatus.WAITING_FOR_FSM:
            self.deferred.add(request.request_id)
        return (request.arrival_time,)

    def seats_held(self, scheduler) -> int:
        requests = scheduler.requests
        self.deferred = {rid for rid in self.deferred  # ready ones leave; ended ones leak
                         if rid not in requests or requests[rid].status is RequestStatus.WAITING_FOR_FSM}
        return len(self.deferred)
