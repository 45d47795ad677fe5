"""RequestTracker: per-request latency and cost, folded from the scheduler's request events.

Definitions (``arrival`` is the request's arrival time; times are seconds, steps are step
numbers; a ``*_steps`` count includes both ends, so a request that arrives at step 3 and gets
its first token in step 3 has ``ttft_steps == 1``):

* ``queue_s``: arrival -> first scheduled;  ``ttft_s``: arrival -> first token;
* ``e2e_s``: arrival -> finished;  ``tpot_s``: (finished - first token) / (outputs - 1),
  undefined (NaN) with fewer than two outputs; ``tpot_steps`` likewise in steps;
* ``num_recomputed_tokens``: per preemption, the tokens computed before it that the
  prefix cache no longer held when the request resumed (``computed - hit at resume``);
* ``num_cached_tokens``: prefix-hit tokens when the request was first scheduled (vLLM's);
* ``arrival_s``: arrival relative to the tracker's ``epoch`` (default: the first arrival).

Events of a request the tracker did not see arrive are ignored.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from workbench.core.request_events import (
    RequestArrived,
    RequestEvent,
    RequestFinished,
    RequestFirstToken,
    RequestPrefixHit,
    RequestPreempted,
    RequestResumed,
    RequestScheduled,
)

#: The columns of :meth:`RequestTracker.dataframe`, in order.
COLUMNS = (
    "request_id", "priority", "num_prompt_tokens", "num_output_tokens",
    "arrival_step", "first_scheduled_step", "first_token_step", "finished_step",
    "arrival_s", "queue_s", "ttft_s", "tpot_s", "e2e_s",
    "ttft_steps", "tpot_steps", "e2e_steps",
    "num_preemptions", "num_recomputed_tokens", "num_cached_tokens", "finish_reason",
)
_STEP_COLUMNS = ("arrival_step", "first_scheduled_step", "first_token_step", "finished_step",
                 "ttft_steps", "e2e_steps")


@dataclass
class _Life:
    """What the tracker knows of one request so far."""

    arrived: RequestArrived
    first_scheduled: RequestEvent | None = None
    first_token: RequestFirstToken | None = None
    finished: RequestFinished | None = None
    num_sampled: int = 0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_cached_tokens: int = 0
    lost_tokens: int = 0  # computed tokens dropped by the pending preemption

    def row(self, epoch: float) -> dict:
        a, first, tok, fin = self.arrived, self.first_scheduled, self.first_token, self.finished
        n_out = fin.num_output_tokens if fin else self.num_sampled

        def since(event, origin):
            return event.time - origin if event is not None else math.nan

        def steps(event):
            return event.step - a.step + 1 if event is not None else None

        tpot_s = tpot_steps = math.nan
        if fin is not None and tok is not None and n_out > 1:
            tpot_s = (fin.time - tok.time) / (n_out - 1)
            tpot_steps = (fin.step - tok.step) / (n_out - 1)
        return {
            "request_id": a.request_id,
            "priority": a.priority,
            "num_prompt_tokens": a.num_prompt_tokens,
            "num_output_tokens": n_out,
            "arrival_step": a.step,
            "first_scheduled_step": first.step if first else None,
            "first_token_step": tok.step if tok else None,
            "finished_step": fin.step if fin else None,
            "arrival_s": a.time - epoch,
            "queue_s": since(first, a.time),
            "ttft_s": since(tok, a.time),
            "tpot_s": tpot_s,
            "e2e_s": since(fin, a.time),
            "ttft_steps": steps(tok),
            "tpot_steps": tpot_steps,
            "e2e_steps": steps(fin),
            "num_preemptions": self.num_preemptions,
            "num_recomputed_tokens": self.num_recomputed_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "finish_reason": fin.reason if fin else None,
        }


class RequestTracker:
    """Folds request events into one row per request (see the module docstring), keeping the
    last ``max_requests`` arrivals (older rows are dropped; their requests, if unfinished,
    are still followed but not shown). A request id reused after its request finished starts
    a new row. O(1) per event.
    """

    def __init__(self, epoch: float | None = None, max_requests: int = 100_000) -> None:
        self.epoch = epoch
        self._lives: deque[_Life] = deque(maxlen=max_requests)
        self._live: dict[str, _Life] = {}  # unfinished requests by id

    def consume(self, events: Iterable[RequestEvent]) -> None:
        live = self._live
        for e in events:
            kind = type(e)
            if kind is RequestScheduled:  # most events: one per scheduled request per step
                life = live.get(e.request_id)
                if life is not None:
                    if life.first_scheduled is None:
                        life.first_scheduled = e
                    life.num_sampled += e.samples
                continue
            if kind is RequestArrived:
                if self.epoch is None:
                    self.epoch = e.time
                life = live[e.request_id] = _Life(e)
                self._lives.append(life)
                continue
            life = live.get(e.request_id)
            if life is None:
                continue
            if isinstance(e, RequestPrefixHit):
                if life.first_scheduled is None:
                    life.num_cached_tokens = e.num_tokens
            elif isinstance(e, RequestPreempted):
                life.num_preemptions += 1
                life.lost_tokens = e.num_computed_tokens
            elif isinstance(e, RequestResumed):
                life.num_recomputed_tokens += max(0, life.lost_tokens - e.num_cached_tokens)
                life.lost_tokens = 0
            elif isinstance(e, RequestFirstToken):
                life.first_token = e
            elif isinstance(e, RequestFinished):
                life.finished = e
                del self._live[e.request_id]

    def __len__(self) -> int:
        return len(self._lives)

    def rows(self) -> list[dict]:
        epoch = self.epoch or 0.0
        return [life.row(epoch) for life in self._lives]

    def dataframe(self):
        """One row per request, in arrival order, with :data:`COLUMNS` (pandas)."""
        import pandas as pd

        frame = pd.DataFrame(self.rows(), columns=list(COLUMNS))
        for col in _STEP_COLUMNS:
            frame[col] = frame[col].astype("Int64")
        return frame

    def __repr__(self) -> str:
        return f"RequestTracker({len(self._lives)} requests, {len(self._live)} unfinished)"

    def _repr_html_(self) -> str:
        return f"<b>RequestTracker</b>: {len(self._lives)} requests" + self.dataframe().tail(20).to_html(index=False)
