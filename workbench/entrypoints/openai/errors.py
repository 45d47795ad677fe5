"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` (vLLM V1's
ErrorResponse, which has no top-level ``object``).

Every failure a client can cause becomes one of these with its HTTP status (400 bad input,
401 API key, 404 unknown model or route, 500 a request that failed inside the engine, 503 the
engine stopped); nothing else in flight is affected.
"""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from workbench.entrypoints.openai import protocol as P
from workbench.entrypoints.openai import responses as R
from workbench.engine.async_llm import EngineDeadError

logger = logging.getLogger("workbench.entrypoints.openai")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error answered as OpenAI-shaped JSON with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    @classmethod
    def bad_request(cls, exc: Exception, fields: set[str] = frozenset()) -> APIError:
        """400 for a validation error: its message, and the field it names as ``param``."""
        if isinstance(exc, P.FieldError):
            return cls(400, str(exc), exc.field)
        return cls(400, str(exc), param_of(str(exc), fields))


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return R.dump(R.ErrorResponse(error=R.ErrorInfo(message=message, type=kind, param=param,
                                                    code=status)))


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def error_event(status: int, message: str) -> str:
    """The SSE event a stream sends before ``[DONE]`` when it ends in an error."""
    return f"data: {json.dumps(error_body(status, message))}\n\n"


def unexpected_error_event(exc: BaseException) -> str:
    """The SSE error event of a stream that failed with an exception nothing else named.

    vLLM V1's stream generators catch every Exception and answer
    ``create_streaming_error_response(e)``, whose ``create_error_response`` classifies it
    (vllm/entrypoints/openai/engine/serving.py): ValueError, TypeError, RuntimeError and
    OverflowError are a 400 BadRequestError, NotImplementedError a 501, anything else a 500
    InternalServerError; the message is the exception's text.
    """
    if isinstance(exc, (ValueError, TypeError, RuntimeError, OverflowError)):
        status = 400
    elif isinstance(exc, NotImplementedError):
        status = 501
    else:
        status = 500
    return error_event(status, str(exc) or type(exc).__name__)


def param_of(message: str, fields: set[str]) -> str | None:
    """The request field a validation message starts with (SamplingParams / engine wording)."""
    m = re.match(r"'?([a-z_]+)'?", message)
    if m and m.group(1) == "prompt_token_ids" and "prompt" in fields:
        return "prompt"
    if m and m.group(1) in fields:
        return m.group(1)
    if message.startswith("Got priority ") and "priority" in fields:  # vLLM's wording
        return "priority"
    if message.startswith(("This model's maximum context length", "The decoder prompt",
                           "Token id ")):
        return "messages" if "messages" in fields else "prompt"
    return None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":  # loc is ("body", character position)
            detail = (err.get("ctx") or {}).get("error", err.get("msg"))
            parts.append(f"Malformed JSON body at character {err['loc'][-1]}: {detail}")
            continue
        cause = (err.get("ctx") or {}).get("error")
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if not loc and err.get("type") == "missing":
            parts.append("The request body is missing: send a JSON object.")
            continue
        if isinstance(cause, P.FieldError):  # a cross-field rule: its own message and field
            param = param or cause.field
            parts.append(str(cause))
            continue
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "Invalid request body.", param


def install_error_handlers(app: FastAPI) -> None:
    """Answer APIError, dead engines, body validation and routing errors OpenAI-shaped."""

    def log_stack(status: int, message: str, exc: BaseException) -> None:
        if getattr(app.state, "log_error_stack", False):  # vLLM's --log-error-stack
            logger.error("error response %d: %s", status, message, exc_info=exc)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        log_stack(exc.status, exc.message, exc)
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        log_stack(400, message, exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return error_response(500, f"{type(exc).__name__}: {exc}")
