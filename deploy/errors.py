"""OpenAI-shaped error bodies and the exception handlers that produce them.

Every error the server returns reads `{"error": {"message", "type", "param", "code"}}`
(vLLM's ErrorResponse): 400 for bad parameters, malformed JSON and prompts over the
context (FastAPI's 422 for a body that fails validation becomes 400, as in vLLM), 401
for a missing or wrong API key, 404 for an unknown model, 413 for a body over
--max-request-body-bytes, 429 (with Retry-After) past --max-concurrent-requests or
--max-response-tokens-in-flight, 500 when the engine fails.
A 5xx body says only INTERNAL_ERROR_MESSAGE: the message a caller gives it (an exception's
text, which can hold file paths or a worker's traceback) goes to the server log.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import TYPE_CHECKING

from raylm.deploy.protocol import ErrorInfo, ErrorResponse

if TYPE_CHECKING:  # FastAPI is imported where a response is built: `OpenAIError` is needed without it
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError",
    HTTPStatus.TOO_MANY_REQUESTS: "RateLimitError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


# gloo's errors, for one, name its source files; a client needs only to know it was not its fault.
INTERNAL_ERROR_MESSAGE = "Internal server error; the server log has the details."


class OpenAIError(Exception):
    """An error a route raises to answer with `status` and an OpenAI error body."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = HTTPStatus(status)
        self.param = param
        # Response headers (a 429's Retry-After).
        self.headers = headers


def error_body(message: str, status: HTTPStatus, param: str | None = None) -> ErrorResponse:
    """The OpenAI error body; for a 5xx, INTERNAL_ERROR_MESSAGE, and `message` is logged."""
    status = HTTPStatus(status)
    if status >= HTTPStatus.INTERNAL_SERVER_ERROR:
        logger.error("Answered %d: %s", int(status), message)
        message = INTERNAL_ERROR_MESSAGE
    return ErrorResponse(error=ErrorInfo(message=message, type=_ERROR_TYPES.get(status, status.phrase.replace(" ", "")
                                                                               + "Error"),
                                         param=param, code=int(status)))


def error_response(message: str, status: HTTPStatus, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(message, status, param).model_dump(), status_code=int(status), headers=headers)


def _error_param(error: dict) -> str | None:
    """The request field a pydantic error is about: the top-level field of its location
    (`loc` also holds list indices and union members, `prompt.list[int].0`), or, for a
    check across fields (a model validator), the `param` its ParameterError names."""
    location = [part for part in error.get("loc", ()) if part != "body"]
    if location:
        return str(location[0])
    return getattr((error.get("ctx") or {}).get("error"), "param", None)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence from pydantic's error list, and the field it names."""
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"The request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}.", None
    param = _error_param(first)
    location = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    message = first.get("msg", "Invalid value")
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    details = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                        for e in errors[:5])
    if len(errors) > 1:
        return f"{message} ({details})", param
    return (f"{location}: {message}" if location else message), param


def _http_error_message(exc: Exception) -> str:
    """The message of an HTTPException. FastAPI answers a body that json.loads raised on
    with anything but a JSONDecodeError (nesting past the recursion limit, bytes that are
    not UTF-8, an integer of thousands of digits) with a bare "There was an error parsing the
    body"; the error it chains says which."""
    cause = exc.__cause__
    if getattr(exc, "status_code", None) != HTTPStatus.BAD_REQUEST or cause is None:
        return str(getattr(exc, "detail", exc))
    if isinstance(cause, RecursionError):
        return "The request body is not JSON the server can read: it nests deeper than its JSON parser goes."
    if isinstance(cause, UnicodeDecodeError):
        return f"The request body is not UTF-8 text: {cause.reason} at byte {cause.start}."
    if isinstance(cause, ValueError):  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        return f"The request body is not JSON the server can read: {str(cause).split(':')[0]}."
    return str(getattr(exc, "detail", exc))


def install_error_handlers(app: FastAPI) -> None:
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, HTTPStatus.BAD_REQUEST, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(_http_error_message(exc), HTTPStatus(exc.status_code))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises `exc` after this answer, so uvicorn logs its traceback.
        return error_response(f"Unhandled {type(exc).__name__}", HTTPStatus.INTERNAL_SERVER_ERROR)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(str(exc), HTTPStatus.BAD_REQUEST, getattr(exc, "param", None))
