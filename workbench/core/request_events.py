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

Events are read-only records (slotted dataclasses, equal and hashable by value). They are
not ``frozen``: a frozen dataclass costs about five times as much to build, and the scheduler
builds one per scheduled request per step.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field


@dataclass(slots=True, unsafe_hash=True)
class RequestEvent:
    request_id: str
    step: int
    time: float = field(default=0.0, repr=False, compare=False)

    kind = "event"

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"


@dataclass(slots=True, unsafe_hash=True)
class RequestArrived(RequestEvent):
    """The request entered the waiting queue."""

    num_prompt_tokens: int = 0
    priority: int = 0

    kind = "arrived"


@dataclass(slots=True, unsafe_hash=True)
class RequestScheduled(RequestEvent):
    """A chunk ran: tokens ``[start, start + num_tokens)``; ``is_prefill`` unless it is one
    generated token; ``samples`` when it reached the last known token (one new token)."""

    start: int = 0
    num_tokens: int = 0
    is_prefill: bool = True
    samples: bool = False

    kind = "scheduled"


@dataclass(slots=True, unsafe_hash=True)
class RequestPrefixHit(RequestEvent):
    """At (re)admission, ``num_tokens`` leading tokens were found in the prefix cache in
    ``block_ids`` and are not computed."""

    num_tokens: int = 0
    block_ids: tuple[int, ...] = ()

    kind = "prefix_hit"


@dataclass(slots=True, unsafe_hash=True)
class RequestPreempted(RequestEvent):
    """Preempted by recompute: its ``block_ids`` were released and the K/V of its
    ``num_computed_tokens`` tokens dropped; what the prefix cache still holds at resume is
    reused, the rest is computed again."""

    block_ids: tuple[int, ...] = ()
    num_computed_tokens: int = 0

    kind = "preempted"


@dataclass(slots=True, unsafe_hash=True)
class RequestResumed(RequestEvent):
    """Readmitted after a preemption; ``num_cached_tokens`` of its tokens were prefix hits."""

    num_cached_tokens: int = 0

    kind = "resumed"


@dataclass(slots=True, unsafe_hash=True)
class RequestFirstToken(RequestEvent):
    """Its first output token was sampled."""

    kind = "first_token"


@dataclass(slots=True, unsafe_hash=True)
class RequestFinished(RequestEvent):
    """Finished with vLLM's ``reason`` ("stop", "length" or "abort"); ``pooled``: a pooling
    request, finished ("stop") by the step that computed its prompt, with no output token."""

    reason: str = ""
    num_output_tokens: int = 0
    pooled: bool = False

    kind = "finished"
