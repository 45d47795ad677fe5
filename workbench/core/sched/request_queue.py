"""The waiting queue: requests in the order the scheduling policy serves them
(:mod:`workbench.core.sched.policies` says who goes first; the queue keeps that order)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from workbench.core.sched.policies import SchedulingPolicy
from workbench.request import Request


class WaitingQueue:
    """Waiting (and preempted) requests in the order the policy serves them.

    Without a policy key: a deque, arrivals at the back, preempted requests at the front.
    With one: a heap on ``(sort_key(request), insertion number)``, the key taken when the
    request enters. Front access is O(1), insertion O(1) / O(log n); ``remove`` (aborts)
    is O(n). Iteration yields the serving order.
    """

    def __init__(self, policy: SchedulingPolicy):
        self._policy = policy
        self._keyed = type(policy).sort_key is not SchedulingPolicy.sort_key
        self._deque: deque[Request] = deque()
        self._heap: list[tuple[object, int, Request]] = []
        self._seq = itertools.count()
        self._skipped: list = []  # heap entries or requests set aside during one pass
        #: Grows whenever a request joins or leaves (not when one is set aside and restored).
        self.version = 0

    def add(self, request: Request) -> None:
        self.version += 1
        if self._keyed:
            heapq.heappush(self._heap, (self._policy.sort_key(request), next(self._seq), request))
        else:
            self._deque.append(request)

    def add_preempted(self, request: Request) -> None:
        """Front of the queue (FCFS order), or the key's place for keyed policies."""
        if self._keyed:
            self.add(request)
        else:
            self.version += 1
            self._deque.appendleft(request)

    def peek(self) -> Request:
        return self._heap[0][2] if self._keyed else self._deque[0]

    def skip_front(self) -> None:
        """Set the front request aside (it keeps its place: see ``restore_skipped``)."""
        self._skipped.append(heapq.heappop(self._heap) if self._keyed else self._deque.popleft())

    def restore_skipped(self) -> None:
        """Put the requests set aside back where they were, in their order."""
        if self._keyed:
            for entry in self._skipped:
                heapq.heappush(self._heap, entry)
        else:
            self._deque.extendleft(reversed(self._skipped))
        self._skipped = []

    def pop(self) -> Request:
        self.version += 1
        return heapq.heappop(self._heap)[2] if self._keyed else self._deque.popleft()

    def remove(self, request: Request) -> None:
        self.version += 1
        if self._keyed:
            self._heap = [e for e in self._heap if e[2] is not request]
            heapq.heapify(self._heap)
        else:
            self._deque.remove(request)

    def __len__(self) -> int:
        return len(self._heap) if self._keyed else len(self._deque)

    def __bool__(self) -> bool:
        return len(self) > 0

    def unordered(self) -> Iterator[Request]:
        """Every waiting request, those set aside in this pass included, in no particular
        order: O(n), no sort (the explainer's walk)."""
        if self._keyed:
            return (e[2] for e in itertools.chain(self._heap, self._skipped))
        return itertools.chain(self._deque, self._skipped)

    def set_aside(self) -> list[Request]:
        """The requests this pass set aside (``skip_front``), until ``restore_skipped``."""
        return [e[2] for e in self._skipped] if self._keyed else list(self._skipped)

    def front(self, n: int) -> list[Request]:
        """The first ``n`` requests in the serving order: O(n) for FCFS, O(len * log n) with a
        sort key (no full sort)."""
        if self._keyed:
            return [e[2] for e in heapq.nsmallest(n, self._heap, key=lambda e: e[:2])]
        return list(itertools.islice(self._deque, n))

    def __iter__(self) -> Iterator[Request]:
        if self._keyed:
            return (e[2] for e in sorted(self._heap, key=lambda e: e[:2]))
        return iter(self._deque)

    def __repr__(self) -> str:
        return f"WaitingQueue([{', '.join(r.request_id for r in self)}])"
