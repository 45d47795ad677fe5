"""The OpenAI-compatible HTTP server: ``build_app(async_llm, model_name=...)`` -> FastAPI app.

Endpoints: ``POST /v1/completions`` (completion.py), ``POST /v1/chat/completions`` (chat.py),
both JSON or SSE (``stream: true``: ``data: {json}\\n\\n`` chunks ending ``data: [DONE]\\n\\n``);
``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize`` (tokenization.py); ``GET /health``;
``POST /v1/embeddings``, ``/pooling``, ``/score``, ``/rerank`` (serving_pooling.py);
``GET /metrics`` (vLLM's ``vllm:`` series from the engine's PrometheusStatLogger); with
``torch_profiler_dir``, ``POST /start_profile`` and ``POST /stop_profile``; with
``VLLM_SERVER_DEV_MODE=1``, ``POST /sleep``, ``POST /wake_up`` and ``GET /is_sleeping``; with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``. Errors are
OpenAI-shaped (errors.py). A client that disconnects has its request aborted (blocks freed).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from fastapi import Body, FastAPI, Query
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from workbench.metrics.prometheus import PrometheusStatLogger
from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.openai.chat import chat_router
from workbench.entrypoints.openai.completion import completion_router
from workbench.entrypoints.openai.errors import APIError, error_response, install_error_handlers
from workbench.entrypoints.openai.serving import OpenAIServing
from workbench.entrypoints.openai.generation_defaults import load_generation_defaults
from workbench.entrypoints.openai.tokenization import tokenization_router
from workbench.entrypoints.openai.request_logger import RequestLogger
from workbench.entrypoints.openai.serving_pooling import generation_refused_router, pooling_router
from workbench.pooling.config import supported_tasks

logger = logging.getLogger("workbench.entrypoints.openai")
_LOGGER_NAME = "prometheus"


class _APIKeyMiddleware:
    """ASGI middleware with vLLM's rule: a path starting ``/v1`` (after the root path) needs an
    ``Authorization`` header whose scheme, before the first space, is ``bearer`` in any case
    and whose rest, unstripped, equals one of the keys (sha256 digests compared in constant
    time). OPTIONS, /health, /metrics, /tokenize and /detokenize pass, as in vLLM (plain
    ASGI, so streaming responses and disconnects pass through untouched)."""

    def __init__(self, app: Any, *, api_keys: list[str]) -> None:
        self.app = app
        self.digests = [hashlib.sha256(k.encode()).digest() for k in api_keys]

    def verify(self, headers: list[tuple[bytes, bytes]]) -> bool:
        value = next((v for k, v in headers if k == b"authorization"), b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        if not value or scheme.lower() != "bearer":
            return False
        given = hashlib.sha256(token.encode()).digest()
        match = False
        for digest in self.digests:  # every key compared: the time does not tell which
            match |= hmac.compare_digest(given, digest)
        return match

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if path.startswith("/v1") and not self.verify(scope["headers"]):
                response = error_response(
                    401, "Unauthorized: a valid API key is required (Authorization: Bearer <key>)."
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def prometheus_logger(async_llm: AsyncLLM, model_name: str) -> PrometheusStatLogger:
    """The engine's PrometheusStatLogger for ``model_name`` (added on first use); with the
    core in a child process, AsyncLLM's own, fed the stats the core ships with its outputs."""
    engine = async_llm.engine
    config = async_llm.config

    def get_or_add() -> PrometheusStatLogger:
        loggers = engine.stat_loggers if engine is not None else async_llm.stat_loggers
        existing = loggers.get(_LOGGER_NAME)
        if isinstance(existing, PrometheusStatLogger) and existing.model_name == model_name:
            return existing
        logger = PrometheusStatLogger(
            model_name, max_model_len=async_llm.model_config.max_model_len,
            max_lora=config.max_loras if config.enable_lora else None)
        if engine is None:
            loggers[_LOGGER_NAME] = logger
            return logger
        if existing is not None:
            engine.remove_logger(_LOGGER_NAME)
        engine.add_logger(_LOGGER_NAME, logger)
        return logger

    return get_or_add() if engine is None else async_llm.submit(get_or_add).result()


def build_app(async_llm: AsyncLLM, *, model_name: str, api_key: str | list[str] | None = None,
              generation_config: str = "auto", enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None,
              lora_modules: Mapping[str, str] | None = None, enable_log_requests: bool = False,
              max_log_len: int | None = None, enable_server_load_tracking: bool = False,
              log_error_stack: bool = False) -> FastAPI:
    """The OpenAI-compatible app over ``async_llm``; ``api_key`` (one key or several) guards
    /v1* (``Authorization: Bearer <key>``, vLLM's rule); ``generation_config`` ("auto", "vllm" or
    a folder) gives the sampling defaults, as vLLM's ``--generation-config``;
    ``enable_auto_tool_choice`` with ``tool_call_parser`` (e.g. "hermes") serve
    ``tool_choice: "auto"``, as vLLM's flags of those names; ``lora_modules``
    (name -> PEFT directory, vLLM's ``--lora-modules``) are loaded now and served under their
    names (the engine needs ``enable_lora``); with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``,
    ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change them at run time.
    vLLM's flags of the same names: ``enable_log_requests`` / ``max_log_len`` (the request
    logger), ``enable_server_load_tracking`` (``GET /load``, see load_tracking.py),
    ``log_error_stack`` (each error answer's traceback logged)."""
    defaults = load_generation_defaults(generation_config, async_llm.model_config.path)
    serving = OpenAIServing(async_llm, model_name, defaults,
                            enable_auto_tools=enable_auto_tool_choice,
                            tool_parser=tool_call_parser)
    for name, path in (lora_modules or {}).items():
        serving.add_lora_module(name, path)
    # Stat logging off (log_stats=False, vLLM's --disable-log-stats): no vllm: series to serve.
    metrics = prometheus_logger(async_llm, model_name) if async_llm.config.log_stats else None
    app = FastAPI(title="llm-workbench OpenAI-compatible server")
    app.state.serving = serving
    if enable_log_requests:
        serving.request_logger = RequestLogger(max_log_len=max_log_len)
    app.state.enable_server_load_tracking = enable_server_load_tracking
    app.state.server_load_metrics = 0
    app.state.log_error_stack = log_error_stack
    install_error_handlers(app)
    if api_key is not None:
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        app.add_middleware(_APIKeyMiddleware, api_keys=keys)
    if "generate" in supported_tasks(async_llm.config.runner, async_llm.config.pooler_config):
        app.include_router(completion_router(serving))
        app.include_router(chat_router(serving))
    else:  # a pooling model (--runner pooling): 400, as vLLM
        app.include_router(generation_refused_router())
    app.include_router(pooling_router(serving))  # each refuses a model without its task
    app.include_router(tokenization_router(serving))

    if enable_server_load_tracking:
        @app.get("/load")
        async def load() -> JSONResponse:
            return JSONResponse({"server_load": app.state.server_load_metrics})

    @app.get("/health")
    async def health() -> Response:
        if not async_llm.is_running:
            error = async_llm.dead_error
            return error_response(503, f"The engine is not running: {error!r}" if error
                                  else "The engine is shut down.")
        return Response(status_code=200)

    if os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true"):
        _add_lora_endpoints(app, serving)

    @app.get("/metrics")
    async def show_metrics() -> Response:
        registry = metrics.registry if metrics is not None else CollectorRegistry()
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    if os.environ.get("VLLM_SERVER_DEV_MODE") == "1":
        _add_dev_endpoints(app, async_llm)

    if async_llm.config.torch_profiler_dir:
        logger.warning("Torch profiler enabled: /start_profile and /stop_profile write traces to %s",
                       async_llm.config.torch_profiler_dir)

        @app.post("/start_profile")
        async def start_profile() -> Response:
            logger.info("Starting profiler...")
            try:
                await async_llm.start_profile()
            except RuntimeError as exc:  # already running
                return error_response(400, str(exc))
            logger.info("Profiler started.")
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile() -> Response:
            logger.info("Stopping profiler...")
            try:
                path = await async_llm.stop_profile()
            except RuntimeError as exc:  # not running
                return error_response(400, str(exc))
            logger.info("Profiler stopped: %s", path)
            return Response(status_code=200)

    return app


def _add_lora_endpoints(app: FastAPI, serving: OpenAIServing) -> None:
    """vLLM's runtime LoRA endpoints (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``):
    ``POST /v1/load_lora_adapter`` {lora_name, lora_path} and ``/v1/unload_lora_adapter``
    {lora_name}; the answers are vLLM's plain-text successes and OpenAI-shaped errors."""
    logger.warning("LoRA dynamic loading & unloading is enabled in the API server. This should "
                   "ONLY be used for local development!")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: dict = Body(...)) -> Response:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        await serving.load_lora_adapter(name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: dict = Body(...)) -> Response:
        name = body.get("lora_name")
        if not name:
            raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                           "lora_name")
        await serving.unload_lora_adapter(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _add_dev_endpoints(app: FastAPI, async_llm: AsyncLLM) -> None:
    """vLLM's dev-mode endpoints (``VLLM_SERVER_DEV_MODE=1``): ``POST /sleep?level=N``,
    ``POST /wake_up?tags=...``, ``GET /is_sleeping``. A refusal is a 400 with the engine's words."""
    logger.warning("SECURITY WARNING: Development endpoints are enabled! This should NOT be used in production!")

    @app.post("/sleep")
    async def sleep(level: int = 1) -> Response:
        try:
            await async_llm.sleep(level)
        except (ValueError, RuntimeError, AssertionError) as exc:  # no sleep mode: vLLM asserts
            return error_response(400, str(exc))
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)) -> Response:
        try:
            await async_llm.wake_up(tags)
        except (ValueError, AssertionError) as exc:
            return error_response(400, str(exc))
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": await async_llm.is_sleeping()})


def make_server(app: FastAPI, async_llm: AsyncLLM, **config: Any):
    """A ``uvicorn.Server`` for ``app`` (``config``: uvicorn.Config's host, port, ...) that
    exits by itself when the engine stops after an error, as vLLM's server does: streams in
    flight get their error event and ``/health`` its 503 before the process stops serving."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, **config))

    def stop_when_the_engine_dies() -> None:
        async_llm.stopped.wait()
        if async_llm.dead_error is not None:
            logger.error("The engine stopped after an error (%r); shutting the server down.",
                         async_llm.dead_error)
            server.should_exit = True

    threading.Thread(target=stop_when_the_engine_dies, name="workbench-engine-watch",
                     daemon=True).start()
    return server
