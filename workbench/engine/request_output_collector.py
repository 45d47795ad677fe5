"""Where one request's outputs wait for its consumer: :class:`RequestOutputCollector`
(vLLM's, for an engine core in a child process) or :class:`OutputQueue` (the in-process
engine thread). Both are used from their consumer's event loop only; ``get()`` raises an
exception put there.

RequestOutputCollector is a slot, not a queue: while the consumer has not taken the waiting output, a newer one is
folded into it. DELTA outputs merge (texts and token ids concatenated, per sequence index),
CUMULATIVE and FINAL_ONLY ones replace it, an exception replaces anything. So a consumer that
lags behind the engine gets fewer, larger chunks and never a backlog; the text it reads is
the same. OutputQueue keeps every output: in process a stream gets one chunk per step that
made new text, however late its consumer reads, which is what the notebooks show and compare.
"""

from __future__ import annotations

import asyncio
import dataclasses

from workbench.outputs import CompletionOutput, RequestOutput
from workbench.sampling_params import RequestOutputKind


def merge_outputs(first: RequestOutput, then: RequestOutput, aggregate: bool) -> RequestOutput:
    """``first`` followed by ``then`` as one output (a new object; neither is changed):
    ``aggregate`` (DELTA) concatenates each sequence's new part, otherwise ``then``'s
    sequences replace ``first``'s of the same index."""
    outputs = list(first.outputs)
    for new in then.outputs:
        at = next((i for i, old in enumerate(outputs) if old.index == new.index), None)
        if at is None:
            outputs.append(new)
        elif aggregate:
            old = outputs[at]
            logprobs = old.logprobs if new.logprobs is None else (old.logprobs or []) + new.logprobs
            outputs[at] = CompletionOutput(
                new.index, old.text + new.text, list(old.token_ids) + list(new.token_ids),
                new.cumulative_logprob, logprobs, new.finish_reason, new.stop_reason)
        else:
            outputs[at] = new
    return dataclasses.replace(
        then, outputs=outputs, finished=first.finished or then.finished,
        prompt_logprobs=first.prompt_logprobs if then.prompt_logprobs is None
        else then.prompt_logprobs)


class RequestOutputCollector:
    """The waiting output of one request (see the module); ``get()`` takes it."""

    def __init__(self, output_kind: RequestOutputKind, request_id: str) -> None:
        self.aggregate = output_kind is RequestOutputKind.DELTA
        self.request_id = request_id
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | BaseException) -> None:
        if self.output is None or isinstance(output, BaseException):
            self.output = output
            self.ready.set()
        elif isinstance(self.output, RequestOutput):
            self.output = merge_outputs(self.output, output, self.aggregate)

    async def get(self) -> RequestOutput:
        """The waiting output, once there is one (raises a waiting exception)."""
        while self.output is None:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self.output is None else self._take()

    def _take(self) -> RequestOutput:
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, BaseException):
            raise output
        return output


class OutputQueue:
    """Every output of one request, in order (see the module)."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, output: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(output)

    async def get(self) -> RequestOutput:
        output = await self._queue.get()
        if isinstance(output, BaseException):
            raise output
        return output
