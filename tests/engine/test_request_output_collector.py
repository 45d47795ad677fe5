"""RequestOutputCollector merges the DELTA outputs its consumer has not taken (vLLM's rule):
the text read is the same however late the consumer comes; other kinds replace, errors win."""

from __future__ import annotations

import asyncio

import pytest

from workbench.engine.request_output_collector import RequestOutputCollector
from workbench.outputs import CompletionOutput, Logprob, RequestOutput
from workbench.sampling_params import RequestOutputKind


def out(parts: dict[int, tuple[str, list[int]]], finished=False, reason=None) -> RequestOutput:
    return RequestOutput("r", "p", [1], [
        CompletionOutput(i, text, ids, -float(len(ids)), [{t: Logprob(-1.0)} for t in ids],
                         reason if finished else None)
        for i, (text, ids) in parts.items()], finished)


def test_lagging_deltas_merge_per_sequence_and_match_the_eager_reading():
    deltas = [out({0: ("a", [1])}), out({1: ("x", [7])}), out({0: ("b", [2]), 1: ("y", [8])}),
              out({0: ("c", [3]), 1: ("z", [9])}, finished=True, reason="length")]

    async def go():
        eager, lagging = (RequestOutputCollector(RequestOutputKind.DELTA, "r") for _ in range(2))
        read = []
        for d in deltas:
            eager.put(d)
            read.append(await eager.get())
            lagging.put(d)
        return read, await lagging.get(), lagging.get_nowait()

    read, merged, nothing = asyncio.run(go())
    assert nothing is None and merged.finished
    for index in (0, 1):
        seq = [c for o in read for c in o.outputs if c.index == index]
        mine = next(c for c in merged.outputs if c.index == index)
        assert mine.text == "".join(c.text for c in seq)
        assert mine.token_ids == [t for c in seq for t in c.token_ids]
        assert len(mine.logprobs) == len(mine.token_ids)
        assert mine.finish_reason == "length"
    assert deltas[0].outputs[0].text == "a"  # the outputs merged are left unchanged


def test_cumulative_replaces_and_an_error_wins():
    async def go():
        c = RequestOutputCollector(RequestOutputKind.CUMULATIVE, "r")
        c.put(out({0: ("a", [1])}))
        c.put(out({0: ("ab", [1, 2])}))
        latest = await c.get()
        c.put(out({0: ("abc", [1, 2, 3])}))
        c.put(RuntimeError("gone"))
        c.put(out({0: ("abcd", [1, 2, 3, 4])}))  # after the error: dropped
        with pytest.raises(RuntimeError, match="gone"):
            await c.get()
        return latest

    assert asyncio.run(go()).outputs[0].text == "ab"


def test_the_in_process_queue_keeps_every_output_in_order():
    from workbench.engine.request_output_collector import OutputQueue

    async def go():
        q = OutputQueue()
        outs = [out({0: ("a", [1])}), out({0: ("b", [2])}, finished=True, reason="stop")]
        for o in outs:
            q.put(o)
        q.put(RuntimeError("after"))
        got = [await q.get(), await q.get()]
        with pytest.raises(RuntimeError, match="after"):
            await q.get()
        return outs, got

    outs, got = asyncio.run(go())
    assert got == outs and got[0] is outs[0]
