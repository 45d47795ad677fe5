"""ParentRequest: one request as the user added it, fanned out into its ``n`` sequences.

It is the single owner of ``n``: it names and parameterises the children (fan-out), holds
back siblings until the first child's prompt is computed (so they share its prompt blocks
through the prefix cache), and folds the children's outputs into one RequestOutput per
step according to ``SamplingParams.output_kind`` (aggregation; a DELTA stream carries the
prompt logprobs whole in its first output and ``[]`` in the later ones, as vLLM). ``n == 1``
is the same object with one child whose id is the request id.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from workbench.outputs import CompletionOutput, RequestMetrics, RequestOutput
from workbench.utils.reprs import html_table
from workbench.request import Request
from workbench.sampling_params import RequestOutputKind, SamplingParams
from workbench.engine.request_state import SequenceState


class ParentRequest:
    """The user's request: ``n`` child sequences reported as one RequestOutput.

    Invariants: ``sequences[i]`` is the output state of ``children[i]``; ``deferred`` holds
    the children not yet handed to the scheduler (child 0's siblings, until
    :meth:`release_siblings`).
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        eos_token_id: int | None = None,
        priority: int = 0,
        arrival_time: float,
        cache_salt: str | None = None,
        lora_request=None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.n = params.n
        #: The child sequences as the scheduler sees them: child ``i`` is ``"{i}_{id}"``
        #: (the id itself when n == 1), seeded ``seed + i`` when the request is seeded.
        self.children = [
            Request(
                self.child_id(i),
                list(prompt_token_ids),
                self.child_params(i),
                eos_token_id=eos_token_id,
                priority=priority,
                arrival_time=arrival_time,
                cache_salt=cache_salt,
                lora_request=lora_request,
            )
            for i in range(self.n)
        ]
        self.deferred: list[Request] = self.children[1:]
        self.sequences: list[SequenceState] = []  # filled by the OutputProcessor
        self._prompt_logprobs_sent = False

    # ------------------------------------------------------------------ fan-out
    def child_id(self, index: int) -> str:
        return self.request_id if self.n == 1 else f"{index}_{self.request_id}"

    def child_params(self, index: int) -> SamplingParams:
        """Child ``index`` samples alone (n=1) with seed ``seed + index`` when seeded, wrapped
        into int64 (so the largest valid seed still gives n valid, distinct seeds). A lone
        child (n=1) takes the request's own parameters (nothing to change: no copy)."""
        if self.params.n == 1:
            return self.params
        seed = self.params.seed
        if seed is not None:
            seed = (seed + index + 2**63) % 2**64 - 2**63
        return dataclasses.replace(self.params, n=1, seed=seed)

    def release_siblings(self) -> list[Request]:
        """The deferred siblings, once child 0 has computed its prompt (got a token) or ended."""
        first = self.children[0]
        if self.deferred and (first.output_token_ids or first.is_finished):
            released, self.deferred = self.deferred, []
            return released
        return []

    # ------------------------------------------------------------------ aggregation
    @property
    def finished(self) -> bool:
        sequences = self.sequences
        if len(sequences) == 1:  # n = 1: read once per request per step
            return sequences[0].finish_reason is not None
        return all(s.finish_reason is not None for s in sequences)

    def make_output(self) -> RequestOutput | None:
        """This step's RequestOutput per the output kind, or None when there is none to give:
        FINAL_ONLY before every child finished, DELTA when no child has anything new."""
        kind = self.params.output_kind
        finished = self.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        completions = [c for s in self.sequences if (c := s.completion(delta)) is not None]
        if delta and not completions:
            return None
        prompt_logprobs = self.sequences[0].prompt_logprobs
        if delta and prompt_logprobs is not None:
            # vLLM's pop_prompt_logprobs: the first delta carries them whole, every later one
            # [] (None stays the sign that prompt logprobs are off).
            prompt_logprobs = [] if self._prompt_logprobs_sent else prompt_logprobs
            self._prompt_logprobs_sent = True
        metrics = self.metrics()
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=metrics,
            num_cached_tokens=metrics.num_cached_tokens,
            prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs),
            error=next((s.error for s in self.sequences if s.error is not None), None),
            kv_transfer_params=self.sequences[0].request.output_kv_transfer_params,
        )

    def error_output(self, message: str) -> RequestOutput:
        """A final output that relies on no per-sequence state (when building one raised)."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[
                CompletionOutput(i, "", [], None, None, finish_reason="error")
                for i in range(self.n)
            ],
            finished=True,
            error=message,
        )

    def metrics(self) -> RequestMetrics:
        """Children aggregated: earliest arrival/schedule/first token, the last finish
        (once all finished), preemptions summed, the largest prefix-cache hit."""
        if len(self.sequences) == 1:  # n = 1 (built at every step of a streamed request)
            state = self.sequences[0]
            r = state.request
            return RequestMetrics(
                arrival_time=r.arrival_time, first_scheduled_time=r.first_scheduled_time,
                first_token_time=r.first_token_time,
                finished_time=state.finished_time if state.finish_reason is not None else None,
                num_preemptions=r.num_preemptions, num_cached_tokens=r.num_cached_tokens)
        reqs = [s.request for s in self.sequences]

        def earliest(values: Iterable[float | None]) -> float | None:
            known = [v for v in values if v is not None]
            return min(known) if known else None

        return RequestMetrics(
            arrival_time=earliest(r.arrival_time for r in reqs),
            first_scheduled_time=earliest(r.first_scheduled_time for r in reqs),
            first_token_time=earliest(r.first_token_time for r in reqs),
            finished_time=(
                max(s.finished_time for s in self.sequences) if self.finished else None
            ),
            num_preemptions=sum(r.num_preemptions for r in reqs),
            num_cached_tokens=max((r.num_cached_tokens for r in reqs), default=0),
        )

    def __repr__(self) -> str:
        done = sum(s.finish_reason is not None for s in self.sequences)
        return (
            f"ParentRequest({self.request_id!r}, n={self.n}, finished={done}/{self.n}, "
            f"deferred={len(self.deferred)}, output_kind={self.params.output_kind.name})"
        )

    def _repr_html_(self) -> str:
        return html_table(f"ParentRequest {self.request_id}", {
            f"sequence {s.index} ({s.request.request_id})": (
                f"{s.request.num_output_tokens} tokens, "
                + (s.finish_reason or ("deferred" if s.request in self.deferred else "running"))
            )
            for s in self.sequences
        })
