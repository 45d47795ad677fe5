"""StepRecord and StepHistory: what each engine step scheduled and why, kept for inspection."""

from __future__ import annotations

import html
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from workbench.core.scheduler_output import SchedulerOutput

#: The stages of a step whose wall time a StepRecord keeps (seconds).
TIMING_STAGES = ("schedule", "prepare", "forward", "sample", "output")


@dataclass(frozen=True)
class StepRecord:
    """One ``LLMEngine.step()``: the batch the scheduler chose, its effects, and timings.

    ``scheduler_output`` is the immutable per-step batch; ``batch`` the packed model inputs
    (None when nothing ran). Counts describe the state *after* the step. Timings are wall
    seconds and are left out of the plain repr so that it stays deterministic.
    """

    step: int
    scheduler_output: SchedulerOutput
    batch: object | None
    sampled_token_ids: dict[str, int]
    finished_request_ids: tuple[str, ...]
    num_running: int
    num_waiting: int
    num_free_blocks: int
    kv_usage: float
    num_blocks_freed: int
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def num_scheduled_tokens(self) -> int:
        return self.scheduler_output.total_num_scheduled_tokens

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduler_output.scheduled if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_scheduled_tokens - self.num_prefill_tokens

    def to_row(self) -> dict:
        so = self.scheduler_output
        row = {
            "step": self.step,
            "num_seqs": len(so.scheduled),
            "num_tokens": self.num_scheduled_tokens,
            "prefill_tokens": self.num_prefill_tokens,
            "decode_tokens": self.num_decode_tokens,
            "token_budget": so.token_budget,
            "new": len(so.new_request_ids),
            "resumed": len(so.resumed_request_ids),
            "preempted": len(so.preempted_request_ids),
            "finished": len(self.finished_request_ids),
            "running": self.num_running,
            "waiting": self.num_waiting,
            "blocks_allocated": so.num_blocks_allocated,
            "blocks_freed": self.num_blocks_freed,
            "blocks_evicted": so.num_blocks_evicted,
            "prefix_hit_tokens": so.num_prefix_cache_hit_tokens,
            "free_blocks": self.num_free_blocks,
            "kv_usage": self.kv_usage,
        }
        row.update({f"t_{k}": self.timings.get(k, 0.0) for k in TIMING_STAGES})
        return row

    def __repr__(self) -> str:
        so = self.scheduler_output
        chunks = ", ".join(
            f"{s.request_id}:{'P' if s.is_prefill else 'D'}{s.num_new_tokens}" for s in so.scheduled
        )
        extra = []
        for name, ids in (
            ("new", so.new_request_ids),
            ("resumed", so.resumed_request_ids),
            ("preempted", so.preempted_request_ids),
            ("finished", self.finished_request_ids),
        ):
            if ids:
                extra.append(f"{name}={list(ids)}")
        return (
            f"StepRecord(step={self.step}, tokens={self.num_scheduled_tokens}/{so.token_budget}, "
            f"[{chunks}]{', ' if extra else ''}{', '.join(extra)}, "
            f"running={self.num_running}, waiting={self.num_waiting}, "
            f"kv_usage={self.kv_usage:.2f})"
        )

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(s.request_id)}</td>"
            f"<td>{'prefill' if s.is_prefill else 'decode'}</td>"
            f"<td>{s.num_computed_tokens}</td><td>{s.num_new_tokens}</td>"
            f"<td>{s.num_cached_tokens}</td><td>{list(s.block_ids)}</td>"
            f"<td>{self.sampled_token_ids.get(s.request_id, '')}</td></tr>"
            for s in self.scheduler_output.scheduled
        )
        return (
            f"<b>Step {self.step}</b>: {self.num_scheduled_tokens} tokens, "
            f"{self.num_running} running, {self.num_waiting} waiting, "
            f"KV usage {self.kv_usage:.0%}"
            "<table><tr><th>request</th><th>kind</th><th>computed</th><th>new tokens</th>"
            "<th>cached</th><th>block table</th><th>sampled</th></tr>" + rows + "</table>"
        )


class StepHistory:
    """The last ``maxlen`` StepRecords, oldest first; indexable like a list."""

    def __init__(self, maxlen: int = 10_000) -> None:
        self._records: deque[StepRecord] = deque(maxlen=maxlen)

    def append(self, record: StepRecord) -> None:
        self._records.append(record)

    def clear(self) -> None:
        self._records.clear()

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[StepRecord]:
        return iter(self._records)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self._records)[index]
        return self._records[index]

    def to_dataframe(self):
        """One row per step (pandas DataFrame indexed by step)."""
        import pandas as pd

        frame = pd.DataFrame([r.to_row() for r in self._records])
        return frame.set_index("step") if len(frame) else frame

    def __repr__(self) -> str:
        return f"StepHistory({len(self)} steps)"

    def _repr_html_(self) -> str:
        """The last ten steps as a table (``to_dataframe()`` has them all)."""
        frame = self.to_dataframe()
        shown = frame.tail(10).drop(columns=[c for c in frame.columns if c.startswith("t_")])
        return f"<b>StepHistory</b>: {len(self)} steps, the last {len(shown)}:" + shown.to_html()
