"""vLLM's ``load_aware_call`` decorator on the generating and pooling routes: with
``--enable-server-load-tracking`` it counts the requests in flight (``GET /load`` answers
``{"server_load": n}``) until each response is fully sent, a stream's too, or the client left;
an SSE stream silent for ``SSE_KEEPALIVE_INTERVAL_SECONDS`` gets a ``: keepalive`` comment (SSE
clients skip comments; proxies see bytes); and a JSON answer to a request that sent
``endpoint-load-metrics-format: TEXT|JSON`` carries the ORCA ``endpoint-load-metrics`` header
(the KV cache's usage and the waiting requests)."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

SSE_KEEPALIVE_INTERVAL_SECONDS = 30.0
ENDPOINT_LOAD_METRICS_FORMAT_HEADER_LABEL = "endpoint-load-metrics-format"


async def sse_with_keepalive(content: AsyncIterator[str],
                             interval_seconds: float | None = None) -> AsyncIterator[str]:
    """``content``'s events, with a comment after every ``interval_seconds`` of silence; the
    pending read survives each timeout (never cancelled by it)."""
    interval = SSE_KEEPALIVE_INTERVAL_SECONDS if interval_seconds is None else interval_seconds
    if interval <= 0:
        raise ValueError("SSE keepalive interval must be positive")
    iterator = aiter(content)
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(iterator))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield ": keepalive\n\n"
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()  # the read in flight ends the source with its cancellation
        else:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def metrics_header(metrics_format: str, scheduler_stats) -> dict[str, str] | None:
    """The ORCA ``endpoint-load-metrics`` header in ``metrics_format`` (TEXT or JSON; None for
    anything else, or no stats yet)."""
    if metrics_format not in ("TEXT", "JSON") or scheduler_stats is None:
        return None
    named = {"kv_cache_usage_perc": float(scheduler_stats.kv_cache_usage),
             "num_requests_waiting": float(scheduler_stats.num_waiting_reqs)}
    if metrics_format == "TEXT":
        return {"endpoint-load-metrics": "TEXT " + ", ".join(
            f"named_metrics.{name}={value}" for name, value in named.items())}
    return {"endpoint-load-metrics": "JSON " + json.dumps({"named_metrics": named})}


class _Counted(Response):
    """``inner``, sent as it is; ``on_done`` runs once it was sent, or the send stopped."""

    def __init__(self, inner: Response, on_done) -> None:  # noqa: D107 - no super(): a proxy
        self.inner, self.on_done = inner, on_done

    @property
    def background(self):
        return self.inner.background

    @background.setter
    def background(self, value) -> None:
        self.inner.background = value

    @property
    def headers(self):
        return self.inner.headers

    @property
    def status_code(self) -> int:
        return self.inner.status_code

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            self.on_done()


def load_aware_call(func):
    """Decorate a route ``(req, raw: Request) -> Response`` (see the module docstring)."""

    @functools.wraps(func)
    async def wrapper(*args, **kwargs):
        raw = next(a for a in (*args, *kwargs.values()) if isinstance(a, Request))
        state = raw.app.state
        tracking = getattr(state, "enable_server_load_tracking", False)
        done = False

        def finished() -> None:
            nonlocal done
            if tracking and not done:
                done = True
                state.server_load_metrics -= 1

        if tracking:
            state.server_load_metrics = getattr(state, "server_load_metrics", 0) + 1
        try:
            response = await func(*args, **kwargs)
        except BaseException:
            finished()
            raise
        if isinstance(response, StreamingResponse) and response.media_type == "text/event-stream":
            response.body_iterator = sse_with_keepalive(response.body_iterator)
        elif isinstance(response, JSONResponse):
            serving = getattr(state, "serving", None)
            header = metrics_header(raw.headers.get(ENDPOINT_LOAD_METRICS_FORMAT_HEADER_LABEL, ""),
                                    serving and serving.llm.scheduler_stats)
            response.headers.update(header or {})
        return _Counted(response, finished) if tracking else response

    return wrapper
