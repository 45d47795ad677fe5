"""Scheduling policies: who waits first and who is preempted.

A policy is a small object with two decisions, both overridable in a notebook::

    class LongestPromptFirst(SchedulingPolicy):
        name = "lpf"
        def sort_key(self, request):          # waiting order: smaller key is served first
            return (-request.num_prompt_tokens, request.arrival_time)

    engine = LLMEngine(EngineConfig(..., policy=LongestPromptFirst()))

* ``sort_key(request)`` orders the waiting queue. ``None`` (the base class, FCFS) keeps
  queue order: arrivals join the back, preempted requests go back to the front. A key
  turns the waiting queue into a heap on ``(key, insertion number)``; a preempted request
  re-enters at its key's place (as vLLM's priority scheduling does).
* ``seats_held(scheduler)``: seats of ``max_num_seqs`` taken besides the running requests
  (0 here).
* ``pick_victim(running)`` names the running request to preempt (by recompute) when a
  running request cannot get KV blocks. The default takes the running request with the
  largest ``sort_key`` -- the one the policy would serve last -- ties (and FCFS) going to
  the newest arrival.

Built-ins: ``fcfs`` (arrival order; victim: newest arrival), ``priority`` (smaller
``priority`` value first, then arrival; victim: largest priority value, ties newest, as
vLLM), ``spf`` shortest prompt first (then arrival; victim: the longest prompt).
The scheduler only asks; it never inspects the policy otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workbench.request import Request


class SchedulingPolicy:
    """Base policy = first come, first served. Override ``sort_key`` and/or ``pick_victim``."""

    name = "fcfs"

    def sort_key(self, request: Request) -> Any | None:
        """Waiting-queue key (smaller first), or None for plain queue order."""
        return None

    def pick_victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt. ``running`` is non-empty, in scheduling order."""
        def rank(item: tuple[int, Request]) -> tuple:
            i, r = item
            key = self.sort_key(r)
            return ((0,) if key is None else (1, key)), r.arrival_time, i

        return max(enumerate(running), key=rank)[1]

    def seats_held(self, scheduler) -> int:
        """Seats of ``max_num_seqs`` the policy counts as taken besides the running requests,
        asked once per step before admission (0: vLLM's gate, running requests only; see
        :mod:`workbench.core.sched.deferred_gate` for the gate of vLLM issue #53130)."""
        return 0

    @property
    def uses_priority(self) -> bool:
        """The one priority rule (offline and over HTTP): False for the built-ins that ignore
        ``Request.priority`` (fcfs, spf and this base class), where a non-zero priority is
        refused as vLLM refuses it without its priority policy; True for ``priority`` and for
        any policy class of your own."""
        return type(self) not in _PRIORITY_BLIND

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FCFSPolicy(SchedulingPolicy):
    """First come, first served; the newest arrival is preempted first."""

    name = "fcfs"


class PriorityPolicy(SchedulingPolicy):
    """Smaller ``request.priority`` first (vLLM's convention), then earlier arrival."""

    name = "priority"

    def sort_key(self, request: Request) -> tuple[int, float]:
        return (request.priority, request.arrival_time)


class ShortestPromptFirstPolicy(SchedulingPolicy):
    """Fewest prompt tokens first, then earlier arrival; the longest prompt is preempted."""

    name = "spf"

    def sort_key(self, request: Request) -> tuple[int, float]:
        return (request.num_prompt_tokens, request.arrival_time)


#: The built-in policies that never read ``Request.priority``.
_PRIORITY_BLIND = (SchedulingPolicy, FCFSPolicy, ShortestPromptFirstPolicy)

POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": FCFSPolicy,
    "priority": PriorityPolicy,
    "spf": ShortestPromptFirstPolicy,
}


def get_policy(policy: str | SchedulingPolicy) -> SchedulingPolicy:
    """A policy object from a name ("fcfs", "priority", "spf") or the object itself."""
    if isinstance(policy, SchedulingPolicy):
        return policy
    if isinstance(policy, str) and policy.lower() in POLICIES:
        return POLICIES[policy.lower()]()
    raise ValueError(
        f"policy must be one of {sorted(POLICIES)} or a SchedulingPolicy instance, got {policy!r}."
    )
