"""The OpenAI-compatible HTTP server: ``build_app(async_llm, model_name=...)`` -> FastAPI app.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE with
``stream: true``: ``data: {json}\\n\\n`` chunks ending ``data: [DONE]\\n\\n``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus), ``POST /tokenize``, ``POST /detokenize``.
Errors are ``{"object": "error", "error": {"message", "type", "param", "code"}}`` with the HTTP
status in ``code``. A client that disconnects has its request aborted (blocks freed).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from workbench.outputs import Logprob, RequestOutput
from workbench.serving import protocol as P
from workbench.serving.async_llm import AsyncLLM, EngineDeadError, RequestStream

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_PROTECTED = ("/v1/", "/tokenize", "/detokenize")


class APIError(Exception):
    """An error answered as OpenAI-shaped JSON with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    body = P.ErrorResponse(error=P.ErrorInfo(message=message, type=kind, param=param, code=status))
    return JSONResponse(P.dump(body), status_code=status)


def _param_of(message: str, fields: set[str]) -> str | None:
    """The request field a validation message starts with (SamplingParams / engine wording)."""
    m = re.match(r"'?([a-z_]+)'?", message)
    return m.group(1) if m and m.group(1) in fields else None


class ServerMetrics:
    """Prometheus metrics of one app, in their own registry."""

    def __init__(self, async_llm: AsyncLLM, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        names = list(labels)
        self.request_success = Counter(
            "workbench:request_success", "Requests that finished, by finish reason.",
            names + ["finished_reason"], registry=r,
        )
        self.request_aborted = Counter(
            "workbench:request_aborted", "Requests aborted because the client went away.",
            names, registry=r,
        ).labels(**labels)
        self.request_errors = Counter(
            "workbench:request_errors", "Requests answered with an error, by HTTP status.",
            names + ["status"], registry=r,
        )
        self.prompt_tokens = Counter(
            "workbench:prompt_tokens", "Prompt tokens of requests that were accepted.", names,
            registry=r,
        ).labels(**labels)
        self.generation_tokens = Counter(
            "workbench:generation_tokens", "Generated tokens.", names, registry=r
        ).labels(**labels)
        self.ttft = Histogram(
            "workbench:time_to_first_token_seconds",
            "Seconds from a request's arrival at the server to its first token.", names,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=r,
        ).labels(**labels)
        for name, doc, read in (
            ("workbench:num_requests_running", "Requests in the running queue.",
             lambda: async_llm.snapshot.num_running),
            ("workbench:num_requests_waiting", "Requests in the waiting queue.",
             lambda: async_llm.snapshot.num_waiting),
            ("workbench:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
             lambda: async_llm.snapshot.kv_usage),
        ):
            Gauge(name, doc, names, registry=r).labels(**labels).set_function(read)
        self._labels = labels

    def success(self, finish_reason: str) -> None:
        self.request_success.labels(**self._labels, finished_reason=finish_reason).inc()

    def error(self, status: int) -> None:
        self.request_errors.labels(**self._labels, status=str(status)).inc()


@dataclass
class _Choice:
    """One choice accumulated from delta outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Tracker:
    """Per-request bookkeeping: accumulated choices, usage and metrics."""

    def __init__(self, metrics: ServerMetrics, n: int) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.choices = [_Choice() for _ in range(n)]
        self.prompt_tokens = 0
        self.first_token_seen = False

    def update(self, out: RequestOutput) -> None:
        self.prompt_tokens = len(out.prompt_token_ids)
        new_tokens = 0
        for c in out.outputs:
            ch = self.choices[c.index]
            ch.text += c.text
            ch.token_ids += c.token_ids
            ch.logprobs += c.logprobs or []
            ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
            new_tokens += len(c.token_ids)
        if new_tokens:
            self.metrics.generation_tokens.inc(new_tokens)
            if not self.first_token_seen:
                self.first_token_seen = True
                self.metrics.ttft.observe(time.monotonic() - self.start)
        if out.finished:
            self.metrics.prompt_tokens.inc(self.prompt_tokens)
            self.metrics.success(self.choices[0].finish_reason or "stop")

    def usage(self) -> P.UsageInfo:
        completion = sum(len(c.token_ids) for c in self.choices)
        return P.UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
        )


def _completion_logprobs(
    token_ids: list[int], positions: list[dict[int, Logprob]], offset: int
) -> P.CompletionLogprobs:
    """Completions-API logprobs of tokens whose text starts ``offset`` characters in."""
    lp = P.CompletionLogprobs()
    for token_id, pos in zip(token_ids, positions):
        chosen = pos[token_id]
        token = chosen.decoded_token or ""
        lp.tokens.append(token)
        lp.token_logprobs.append(chosen.logprob)
        ranked = sorted(pos.values(), key=lambda v: v.rank or 0)
        lp.top_logprobs.append({v.decoded_token or "": v.logprob for v in ranked})
        lp.text_offset.append(offset)
        offset += len(token)
    return lp


def _chat_logprobs(
    token_ids: list[int], positions: list[dict[int, Logprob]], top_k: int
) -> P.ChatLogprobs:
    """Chat-API logprobs: each sampled token with the ``top_k`` most likely candidates."""

    def entry(v: Logprob) -> dict[str, Any]:
        token = v.decoded_token or ""
        return {"token": token, "logprob": v.logprob, "bytes": list(token.encode("utf-8"))}

    content = []
    for token_id, pos in zip(token_ids, positions):
        top = sorted(
            (v for v in pos.values() if v.rank is not None and v.rank <= top_k),
            key=lambda v: v.rank,
        )[:top_k]
        content.append(P.ChatTokenLogprob(**entry(pos[token_id]), top_logprobs=[entry(v) for v in top]))
    return P.ChatLogprobs(content=content)


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def _until_disconnect(raw: Request, work: Awaitable[Response]) -> Response:
    """Await ``work`` unless the client disconnects first (then ``work`` is cancelled, which
    aborts its request, and an empty 499 response is returned to nobody)."""
    task = asyncio.ensure_future(work)

    async def listen() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(listen())
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return Response(status_code=499)


class _SSEResponse(StreamingResponse):
    """An SSE StreamingResponse that closes its request's stream however it ends, also when
    it is cancelled before its body generator ever ran."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], closer: _closing) -> None:
        super().__init__(content, media_type=self.media_type)
        self.closer = closer

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.closer.close()


class _Server:
    """The endpoint handlers of one app."""

    def __init__(self, async_llm: AsyncLLM, model_name: str) -> None:
        self.llm = async_llm
        self.engine = async_llm.engine
        self.model_name = model_name
        self.max_model_len = async_llm.engine.model_config.max_model_len
        self.metrics = ServerMetrics(async_llm, model_name)

    # ------------------------------------------------------------------ helpers
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    async def open_stream(
        self, prompt: Any, params_fn: Callable[[], Any], request_id: str, fields: set[str]
    ) -> RequestStream:
        """Build SamplingParams and add the request; ValueError -> APIError(400)."""
        try:
            params = params_fn()
            return await self.llm.add_request(prompt, params, request_id)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), _param_of(str(exc), fields)) from exc

    async def render_chat(self, messages: list[P.ChatMessage], add_generation_prompt: bool,
                          chat_template: str | None) -> dict[str, Any]:
        conversation = [{"role": m.role, "content": m.text()} for m in messages]

        def render() -> dict[str, Any]:
            text = self.engine.input_processor.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            ids = self.engine.tokenizer(text, add_special_tokens=False).input_ids
            return {"prompt": text, "prompt_token_ids": ids}

        try:
            return await self.llm.call(render)
        except ValueError as exc:
            raise APIError(400, str(exc), "messages") from exc

    # ------------------------------------------------------------------ completions
    async def completions(self, req: P.CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(
                    400, f"prompt must be one prompt (a string or a list of token ids); batches "
                    f"are not supported, got a list of {len(prompt)} prompts.", "prompt",
                )
            prompt = prompt[0]
        if isinstance(prompt, list):
            prompt = {"prompt_token_ids": prompt}
        echo = ""
        if req.echo:
            echo = prompt if isinstance(prompt, str) else await self.llm.call(
                lambda: self.engine.tokenizer.decode(prompt["prompt_token_ids"])
            )
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await self.open_stream(
            prompt, req.to_sampling_params, request_id, set(P.CompletionRequest.model_fields)
        )
        tracker = _Tracker(self.metrics, req.n)
        created = int(time.time())
        closer = _closing(stream, self.metrics)
        if req.stream:
            return _SSEResponse(
                self._completion_events(closer, tracker, req, request_id, created, echo), closer
            )
        with closer:
            return await _until_disconnect(
                raw, self._completion_full(stream, tracker, req, request_id, created, echo)
            )

    async def _completion_full(self, stream, tracker, req, request_id, created, echo) -> Response:
        async for out in stream:
            tracker.update(out)
        choices = [
            P.CompletionChoice(
                index=i,
                text=echo + c.text,
                logprobs=(
                    None if req.logprobs is None
                    else _completion_logprobs(c.token_ids, c.logprobs, len(echo))
                ),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for i, c in enumerate(tracker.choices)
        ]
        body = P.CompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices,
            usage=tracker.usage(),
        )
        return JSONResponse(P.dump(body))

    async def _completion_events(self, closer, tracker, req, request_id, created, echo
                                 ) -> AsyncIterator[str]:
        def chunk(choices: list[P.CompletionChoice], usage: P.UsageInfo | None = None) -> str:
            return _sse(P.dump(P.CompletionResponse(
                id=request_id, created=created, model=self.model_name, choices=choices,
                usage=usage,
            )))

        started = [False] * req.n
        async with closer as stream:
            try:
                async for out in stream:
                    offsets = [len(echo) + len(c.text) for c in tracker.choices]
                    tracker.update(out)
                    for c in out.outputs:
                        text = c.text if started[c.index] else echo + c.text
                        started[c.index] = True
                        if not text and c.finish_reason is None and req.logprobs is None:
                            continue  # the detokenizer held the text back: nothing to say yet
                        logprobs = None
                        if req.logprobs is not None:
                            logprobs = _completion_logprobs(
                                c.token_ids, c.logprobs or [], offsets[c.index]
                            )
                        yield chunk([P.CompletionChoice(
                            index=c.index, text=text, logprobs=logprobs,
                            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                        )])
                if req.include_usage:
                    yield chunk([], tracker.usage())
            except EngineDeadError as exc:
                yield _sse(P.dump(P.ErrorResponse(error=P.ErrorInfo(
                    message=str(exc), type=_ERROR_TYPES[503], code=503))))
        yield _sse("[DONE]")

    # ------------------------------------------------------------------ chat
    async def chat(self, req: P.ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        prompt = await self.render_chat(req.messages, req.add_generation_prompt, req.chat_template)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self.open_stream(
            prompt, req.to_sampling_params, request_id, set(P.ChatCompletionRequest.model_fields)
        )
        tracker = _Tracker(self.metrics, req.n)
        created = int(time.time())
        closer = _closing(stream, self.metrics)
        if req.stream:
            return _SSEResponse(self._chat_events(closer, tracker, req, request_id, created), closer)
        with closer:
            return await _until_disconnect(
                raw, self._chat_full(stream, tracker, req, request_id, created)
            )

    async def _chat_full(self, stream, tracker, req, request_id, created) -> Response:
        async for out in stream:
            tracker.update(out)
        choices = [
            P.ChatChoice(
                index=i,
                message=P.ChatResponseMessage(content=c.text),
                logprobs=(
                    _chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                    if req.logprobs else None
                ),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for i, c in enumerate(tracker.choices)
        ]
        body = P.ChatCompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices,
            usage=tracker.usage(),
        )
        return JSONResponse(P.dump(body))

    async def _chat_events(self, closer, tracker, req, request_id, created) -> AsyncIterator[str]:
        def chunk(choices: list[P.ChatStreamChoice], usage: P.UsageInfo | None = None) -> str:
            return _sse(P.dump(P.ChatCompletionChunk(
                id=request_id, created=created, model=self.model_name, choices=choices,
                usage=usage,
            )))

        async with closer as stream:
            try:
                for i in range(req.n):  # the first chunk of each choice carries the role
                    yield chunk([P.ChatStreamChoice(
                        index=i, delta={"role": "assistant", "content": ""})])
                async for out in stream:
                    tracker.update(out)
                    for c in out.outputs:
                        if not c.text and c.finish_reason is None and not req.logprobs:
                            continue
                        logprobs = None
                        if req.logprobs:
                            logprobs = _chat_logprobs(
                                c.token_ids, c.logprobs or [], req.top_logprobs or 0
                            )
                        yield chunk([P.ChatStreamChoice(
                            index=c.index, delta={"content": c.text}, logprobs=logprobs,
                            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                        )])
                if req.include_usage:
                    yield chunk([], tracker.usage())
            except EngineDeadError as exc:
                yield _sse(P.dump(P.ErrorResponse(error=P.ErrorInfo(
                    message=str(exc), type=_ERROR_TYPES[503], code=503))))
        yield _sse("[DONE]")

    # ------------------------------------------------------------------ tokenizer
    async def tokenize(self, req: P.TokenizeRequest) -> Response:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Give exactly one of 'prompt' and 'messages'.", "prompt")
        if req.messages is not None:
            rendered = await self.render_chat(req.messages, req.add_generation_prompt, None)
            ids = rendered["prompt_token_ids"]
        else:
            text, special = req.prompt, req.add_special_tokens
            ids = await self.llm.call(
                lambda: self.engine.tokenizer(text, add_special_tokens=special).input_ids
            )
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len})

    async def detokenize(self, req: P.DetokenizeRequest) -> Response:
        self.check_model(req.model)
        vocab = self.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be integers in [0, {vocab}), got {bad[0]}.", "tokens")
        tokens = list(req.tokens)
        text = await self.llm.call(lambda: self.engine.tokenizer.decode(tokens))
        return JSONResponse({"prompt": text})


class _closing:
    """``(async) with`` or ``close()``: close the stream (aborting it unless it finished) and
    count the abort, once. Exactly one per request."""

    def __init__(self, stream: RequestStream, metrics: ServerMetrics) -> None:
        self.stream, self.metrics = stream, metrics
        self._done = False

    async def __aenter__(self) -> RequestStream:
        return self.stream

    async def __aexit__(self, *exc_info) -> None:
        self.close()

    def __enter__(self) -> RequestStream:
        return self.stream

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        self.stream.close()
        if self.stream.aborted:
            self.metrics.request_aborted.inc()


class _APIKeyMiddleware:
    """ASGI middleware: /v1/*, /tokenize and /detokenize need ``Authorization: Bearer KEY``
    (plain ASGI, so streaming responses and disconnects pass through untouched)."""

    def __init__(self, app: Any, *, api_key: str, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] == "http" and scope["method"] != "OPTIONS"
                and scope["path"].startswith(_PROTECTED)):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                self.metrics.error(401)
                response = error_response(
                    401, "Unauthorized: a valid API key is required (Authorization: Bearer <key>)."
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(async_llm: AsyncLLM, *, model_name: str, api_key: str | None = None) -> FastAPI:
    """The OpenAI-compatible app over ``async_llm``; ``api_key`` guards /v1/*, /tokenize and
    /detokenize (``Authorization: Bearer <key>``)."""
    server = _Server(async_llm, model_name)
    app = FastAPI(title="llm-workbench OpenAI-compatible server")
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        server.metrics.error(exc.status)
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        server.metrics.error(503)
        return error_response(503, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts, param = [], None
        for err in exc.errors():
            if err.get("type") == "json_invalid":  # loc is ("body", character position)
                detail = (err.get("ctx") or {}).get("error", err.get("msg"))
                parts.append(f"Malformed JSON body at character {err['loc'][-1]}: {detail}")
                continue
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            where = ".".join(loc)
            param = param or where or None
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        server.metrics.error(400)
        return error_response(400, "; ".join(parts) or "Invalid request body.", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    if api_key is not None:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key, metrics=server.metrics)

    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, raw: Request) -> Response:
        return await server.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat(req: P.ChatCompletionRequest, raw: Request) -> Response:
        return await server.chat(req, raw)

    @app.get("/v1/models")
    async def models() -> Response:
        card = P.ModelCard(id=model_name, max_model_len=server.max_model_len)
        return JSONResponse(P.dump(P.ModelList(data=[card])))

    @app.get("/health")
    async def health() -> Response:
        if not async_llm.is_running:
            error = async_llm.dead_error
            return error_response(503, f"The engine is not running: {error!r}" if error
                                  else "The engine is shut down.")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(generate_latest(server.metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(req: P.TokenizeRequest) -> Response:
        return await server.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: P.DetokenizeRequest) -> Response:
        return await server.detokenize(req)

    return app
