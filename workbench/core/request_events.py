"""Request events: each request's life as the scheduler sees it, in the order it happened.

Every event names the request, the ``step`` it belongs to and the monotonic ``time`` it
happened (left out of repr and equality, so logs of two runs compare by what happened).
Steps: an arrival belongs to the first step that can schedule the request; scheduling,
preemption, first token and a finish by a stop condition to the step they happen in; a
finish by ``finish_requests`` (an abort, a stop string) to the last step that ran before it.

One request's events come in this order: ``RequestArrived``; then per admission an optional
``RequestResumed`` (after a preemption) and ``RequestPrefixHit``, and one ``RequestScheduled``
per step it runs; ``RequestFirstToken`` once; ``RequestPreempted`` any number of times;
``RequestFinished`` last.

Events are read-only records, equal and hashable by value (``time`` aside): frozen
``msgspec.Struct``s, built in C and not tracked by the cycle collector (they hold strings,
numbers and tuples of ints), because the scheduler builds one per scheduled request per step;
a slotted dataclass costs about three times as much to build (a frozen one more).
"""

from __future__ import annotations

import html
from operator import attrgetter

import msgspec


class RequestEvent(msgspec.Struct, frozen=True, gc=False):
    request_id: str
    step: int
    time: float = 0.0  # left out of repr, equality and hash

    kind = "event"

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__struct_fields__ if name != "time")
        return f"{type(self).__name__}({shown})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._compared(self) == self._compared(other)

    def __hash__(self) -> int:
        return hash(self._compared(self))

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"


class RequestArrived(RequestEvent, frozen=True, gc=False):
    """The request entered the waiting queue."""

    num_prompt_tokens: int = 0
    priority: int = 0

    kind = "arrived"


class RequestScheduled(RequestEvent, frozen=True, gc=False):
    """A chunk ran: tokens ``[start, start + num_tokens)``; ``is_prefill`` unless it is one
    generated token; ``samples`` when it reached the last known token (one new token)."""

    start: int = 0
    num_tokens: int = 0
    is_prefill: bool = True
    samples: bool = False

    kind = "scheduled"


class RequestPrefixHit(RequestEvent, frozen=True, gc=False):
    """At (re)admission, ``num_tokens`` leading tokens were found in the prefix cache in
    ``block_ids`` and are not computed."""

    num_tokens: int = 0
    block_ids: tuple[int, ...] = ()

    kind = "prefix_hit"


class RequestPreempted(RequestEvent, frozen=True, gc=False):
    """Preempted by recompute: its ``block_ids`` were released and the K/V of its
    ``num_computed_tokens`` tokens dropped; what the prefix cache still holds at resume is
    reused, the rest is computed again."""

    block_ids: tuple[int, ...] = ()
    num_computed_tokens: int = 0

    kind = "preempted"


class RequestResumed(RequestEvent, frozen=True, gc=False):
    """Readmitted after a preemption; ``num_cached_tokens`` of its tokens were prefix hits."""

    num_cached_tokens: int = 0

    kind = "resumed"


class RequestFirstToken(RequestEvent, frozen=True, gc=False):
    """Its first output token was sampled."""

    kind = "first_token"


class RequestFinished(RequestEvent, frozen=True, gc=False):
    """Finished with vLLM's ``reason`` ("stop", "length" or "abort"); ``pooled``: a pooling
    request, finished ("stop") by the step that computed its prompt, with no output token."""

    reason: str = ""
    num_output_tokens: int = 0
    pooled: bool = False

    kind = "finished"


def _compare_all_but_time() -> None:
    """Each event class's ``_compared``: its fields but ``time``, as one tuple."""
    for cls in (RequestEvent, *RequestEvent.__subclasses__()):
        cls._compared = attrgetter(*[name for name in cls.__struct_fields__ if name != "time"])


_compare_all_but_time()
