"""Nothing one request carries stops the server: a request that fails inside the engine ends
alone (500, or an error event then ``[DONE]``) while the others stream the same tokens as
without it; a multi-megabyte prompt is tokenized off the engine thread, so running streams
keep their pace; clients that leave in any way free their blocks; extreme valid values serve."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import statistics
import time

import pytest

from workbench import SamplingParams
from workbench.core.request_events import RequestFinished

from serving_support import (
    GOOD, client, drive_asgi, serving_fixtures, sse_events, steps_that_ran, wait_all_free,
)

BLOCKS = 160
async_llm, app = serving_fixtures(BLOCKS)


def fails_after(k: int):
    def processor(output_token_ids, logits):
        if len(output_token_ids) >= k:
            raise RuntimeError("injected fault")
        return logits

    return processor


@pytest.fixture
def inject_fault(async_llm, monkeypatch):
    """Requests whose prompt contains FAULT get a logits processor that raises after 3
    tokens (the HTTP API has no way to send a callable; this is the notebook user's path)."""
    processor = async_llm.engine.input_processor
    original = processor.process

    def process(prompt, params, **kw):
        text, ids, params = original(prompt, params, **kw)
        if text and "FAULT" in text:
            params = dataclasses.replace(params, logits_processors=[fails_after(3)])
        return text, ids, params

    monkeypatch.setattr(processor, "process", process)


GOOD_PROMPTS = ["ROMEO:", "JULIET:\nO Romeo", "HAMLET:\nTo be"]


def run_streams(app, extra=()):
    async def go():
        async with client(app) as c:
            calls = [c.post("/v1/completions", json={**GOOD, "prompt": p, "max_tokens": 12,
                                                     "stream": True}) for p in GOOD_PROMPTS]
            calls += [c.post(path, json=body) for path, body in extra]
            return await asyncio.gather(*calls)

    return asyncio.run(go())


def stream_text(response) -> str:
    return "".join(ch["choices"][0]["text"] for ch in sse_events(response.text) if ch["choices"])


def test_a_failing_request_ends_alone_and_the_others_are_unchanged(app, async_llm, inject_fault):
    reference = [stream_text(r) for r in run_streams(app)]
    faulty = [
        ("/v1/completions", {**GOOD, "prompt": "FAULT:", "max_tokens": 12, "stream": True}),
        ("/v1/completions", {**GOOD, "prompt": "FAULT!", "max_tokens": 12}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "FAULT"}],
                                  "max_tokens": 12, "stream": True}),
    ]
    *good, streamed, whole, chat = run_streams(app, faulty)
    assert [stream_text(r) for r in good] == reference

    for response in (streamed, chat):
        events = response.text.split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        error = json.loads(events[-3][len("data: "):])["error"]
        assert error["code"] == 500 and error["type"] == "InternalServerError"
        assert "RuntimeError: injected fault" in error["message"]
        tokens = [json.loads(e[6:]) for e in events[:-3]]
        assert all(t["choices"][0].get("finish_reason") != "length" for t in tokens if t["choices"])
    assert whole.status_code == 500
    assert "RuntimeError: injected fault" in whole.json()["error"]["message"]
    assert set(whole.json()["error"]) == {"message", "type", "param", "code"}

    async def after():
        await wait_all_free(async_llm, num_blocks=BLOCKS)  # no block leaked
        async with client(app) as c:
            return await c.get("/health"), await c.post("/v1/completions", json=GOOD)

    health, served = asyncio.run(after())
    assert health.status_code == 200 and served.json()["usage"]["completion_tokens"] == 8


def test_huge_prompt_does_not_pause_running_streams(app, async_llm):
    """A ~2 MB prompt is tokenized (seconds) while a stream runs: the stream's largest gap
    between tokens in that window stays near its own median gap. Tokenized on the engine
    thread, that gap would be the whole window (measured: 1.46 s of a 1.47 s window).

    The stream is read until a few tokens after the window (or its end), so that a stall
    reaching the window's end is seen; before, the stream was closed at the window's end and
    such a stall was never measured. The bound (20 medians, or half the window) leaves room
    for the OS descheduling us on a busy 2-core box: a CI run late in the suite saw one 0.67 s
    pause in a 1.79 s window (of unknown cause; not the cycle collector: tokenizing this
    prompt set off no collection, even over a heap of 4 million objects)."""
    huge = "ROMEO:\nBut soft, what light through yonder window breaks? " * 36_000
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)

    async def go():
        arrivals: list[float] = []
        stream = await async_llm.add_request("JULIET:", params, "steady")

        async def consume():
            async for out in stream:
                arrivals.extend([time.perf_counter()] * len(out.outputs[0].token_ids))

        consumer = asyncio.create_task(consume())
        while len(arrivals) < 20:
            await asyncio.sleep(0.005)
        async with client(app) as c:
            start = time.perf_counter()
            answer = await c.post("/v1/completions", json={**GOOD, "prompt": huge})
            end = time.perf_counter()
        seen = len(arrivals)
        while len(arrivals) < seen + 5 and not consumer.done() and time.perf_counter() < end + 10:
            await asyncio.sleep(0.005)
        stream.close()
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await wait_all_free(async_llm, num_blocks=BLOCKS)
        return arrivals, start, end, answer

    arrivals, start, end, answer = asyncio.run(go())
    assert answer.status_code == 400 and "maximum context length" in answer.text
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > a]
    median = statistics.median(gaps)
    window = [t for t in arrivals if start <= t <= end]
    in_window = [(b - a, a - start) for a, b in zip(arrivals, arrivals[1:])
                 if start <= b and a <= end]
    # on the engine thread, tokenizing would stall the stream for the whole window
    assert end - start > 1.2, "the prompt was too small to show a stall"
    assert len(window) >= 5
    worst, at = max(in_window)
    assert worst < max(20 * median, 0.5 * (end - start)), (worst, at, median, end - start)


def test_load_with_disconnects_and_cancellations_frees_everything(app, async_llm):
    """Under load, requests whose client disconnects (streaming, after 0-3 chunks; whole,
    at once) or whose task is cancelled end then: each that reached the engine ended "abort"
    within a fraction of its 400 steps (run to the end, as without the abort, they would free
    their blocks too); the others finish."""
    rng = random.Random(0)
    max_tokens = 400
    body = {**GOOD, "prompt": "OTHELLO:", "max_tokens": max_tokens}

    async def go():
        async with client(app) as c:
            finishers = [asyncio.create_task(c.post("/v1/completions", json={
                **GOOD, "prompt": p, "max_tokens": 10, "stream": bool(i % 2)}))
                for i, p in enumerate(GOOD_PROMPTS * 2)]
            leavers = []
            for i in range(9):  # a whole answer comes at the end: its client leaves at once
                stream = i % 3 != 0
                leavers.append(asyncio.create_task(drive_asgi(
                    app, {**body, "stream": stream, "request_id": f"leave-{i}"},
                    rng.randint(0, 3) if stream else 0)))
            cancelled = [asyncio.create_task(c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Speak."}], "max_tokens": max_tokens,
                "ignore_eos": True, "request_id": f"cancel-{i}"}))
                for i in range(4)]
            await asyncio.sleep(0.2)
            for task in cancelled:
                task.cancel()
            done = await asyncio.gather(*finishers)
            await asyncio.gather(*leavers, *cancelled, return_exceptions=True)
        await wait_all_free(async_llm, num_blocks=BLOCKS)
        history = await async_llm.get_history()
        ids = [f"cmpl-leave-{i}-0" for i in range(9)] + [f"chatcmpl-cancel-{i}" for i in range(4)]
        ran = {rid: steps_that_ran(history, rid) for rid in ids}
        reasons = {rid: [e.reason for e in history.request_log(rid)
                         if isinstance(e, RequestFinished)] for rid in ids}
        return done, ran, reasons

    done, ran, reasons = asyncio.run(go())
    assert all(r.status_code == 200 for r in done)
    # each ended "abort", or left before the engine had it (a busy box: [] and 0 steps)
    assert all(r in ([], ["abort"]) for r in reasons.values()), reasons
    assert sum(r == ["abort"] for r in reasons.values()) >= len(reasons) // 2, reasons
    assert all(n < max_tokens // 2 for n in ran.values()), ran
    assert async_llm.is_running


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 0])
def test_extreme_valid_seeds_are_served(app, seed):
    async def go():
        async with client(app) as c:
            return await c.post("/v1/completions", json={**GOOD, "temperature": 1.0, "n": 2,
                                                         "seed": seed, "max_tokens": 3})

    response = asyncio.run(go())
    assert response.status_code == 200, response.text
    assert [c["index"] for c in response.json()["choices"]] == [0, 1]
