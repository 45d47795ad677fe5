"""ViewSource: what a view reads, whether it was given a live engine, a history or a RunResult.

Views never change the engine; they ask this object for the recorded steps, the KV pool as it
was after a step, the per-request metrics, and a tokenizer to show tokens as text.
"""

from __future__ import annotations


class ViewSource:
    """Normalises ``engine | StepHistory | RunResult`` for the views.

    ``engine`` is None unless a live engine was given (only then can a view step it);
    ``history`` is the StepHistory; ``tokenizer`` may be None (token ids are then shown as ids).
    """

    def __init__(self, source, tokenizer=None, *, live: bool = True) -> None:
        if isinstance(source, ViewSource):
            self.engine, self.history, self.run = source.engine, source.history, source.run
            self.tokenizer = tokenizer or source.tokenizer
            self.live = source.live and live
            return
        #: False for an engine another thread steps (``%llm serve``): views then offer no
        #: buttons that drive the engine.
        self.live = live
        self.run = None  # a RunResult, when one was given
        self.engine = source if hasattr(source, "kv_cache") and hasattr(source, "step") else None
        if self.engine is not None:
            self.history = self.engine.history
            tokenizer = tokenizer or self.engine.tokenizer
        elif hasattr(source, "history"):
            self.run, self.history = source, source.history
            tokenizer = tokenizer or getattr(source, "tokenizer", None)
        elif hasattr(source, "kv_state"):
            self.history = source
        else:
            raise TypeError(
                f"a view needs an LLMEngine, a StepHistory or a RunResult, got {type(source).__name__}."
            )
        self.tokenizer = tokenizer

    # ---------------------------------------------------------------- steps
    def records(self) -> list:
        """The kept StepRecords, oldest first: a copy taken at once, so another thread
        appending steps meanwhile does not disturb a view iterating over them."""
        return self.history[:]

    @property
    def steps(self) -> list[int]:
        """Step numbers of the recorded steps still kept, oldest first."""
        return list(self.history.steps)

    @property
    def last_step(self) -> int | None:
        steps = self.history.steps
        return steps[-1] if steps else None

    def record(self, step: int):
        """The StepRecord of ``step`` (a step number, not a position)."""
        return self.history.record(step)

    def first_step_note(self) -> str:
        """Where the kept steps start and why, when not at step 0 ("" otherwise)."""
        steps = self.history.steps
        if not steps or steps[0] == 0:
            return ""
        return (f"steps before {steps[0]} are not kept (the history was cleared or trimmed; "
                f"step numbers count on from the engine's first step)")

    def pending(self, known) -> list[str]:
        """Ids the live engine holds waiting that ``known`` (the ids the recorded steps saw)
        lacks: requests added since the last step, whose arrival belongs to the next step."""
        if self.engine is None or not self.live:
            return []
        return [r.request_id for r in list(self.engine.scheduler.waiting) if r.request_id not in known]

    # ----------------------------------------------------------------- pool
    def kv_state(self, step: int | None = None, *, during_forward: bool = False):
        """The KV pool after ``step`` (None: the latest recorded step), rebuilt from the
        recorded block events -- immutable, so a view redrawing on another thread while the
        engine steps reads a consistent pool. Before any step: the live pool's snapshot.
        ``during_forward``: as the step's forward pass saw it (``StepHistory.kv_state``)."""
        step = self.last_step if step is None else step
        if step is not None:
            return self.history.kv_state(step, during_forward=during_forward)
        if self.engine is None:
            raise IndexError("no steps recorded yet.")
        return self.engine.kv_cache.snapshot()

    @property
    def policy_name(self) -> str:
        """The scheduling policy's name, as far as the source tells ("?" otherwise)."""
        if self.engine is not None:
            return self.engine.scheduler.policy.name
        policy = getattr(getattr(self.run, "config", None), "policy", "?")
        return policy if isinstance(policy, str) else getattr(policy, "name", "?")

    def scheduler_setting(self, name: str):
        """A scheduler setting (``max_num_seqs``, ``enable_chunked_prefill``), None if unknown."""
        if self.engine is not None:
            return getattr(self.engine.scheduler, name)
        return getattr(getattr(self.run, "config", None), name, None)

    # ------------------------------------------------------------- requests
    def requests(self):
        """The per-request DataFrame (queue time, TTFT, ...), or None when the source has none."""
        if self.engine is not None:
            return self.engine.requests_dataframe()
        return self.run.requests if self.run is not None else None

    def request_row(self, request_id: str) -> dict:
        """One request's row of :meth:`requests` as a dict ({} when unknown)."""
        frame = self.requests()
        if frame is None or not len(frame):
            return {}
        if "request_id" in frame.columns:
            frame = frame.set_index("request_id")
        return frame.loc[request_id].to_dict() if request_id in frame.index else {}

    # ----------------------------------------------------------------- text
    def decode(self, token_ids) -> str:
        """Token ids as text (ids in brackets when there is no tokenizer)."""
        token_ids = list(token_ids)
        if self.tokenizer is None:
            return str(token_ids)
        return self.tokenizer.decode(token_ids)
