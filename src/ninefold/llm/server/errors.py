"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server reports goes through :class:`APIError`, so a client mistake always gets
its 4xx status and JSON body, and nothing (not even an unexpected server fault) returns a traceback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("ninefold.server")

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error with an HTTP status that is reported to the client as OpenAI error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        """This error as a JSON response with its status and headers."""
        return _AsciiJSONResponse(self.body(), status_code=self.status, headers=self.headers)


class _AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message that quotes the client's text (an unpaired
    surrogate included, which has no UTF-8 form) still renders."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error naming the offending parameter."""
    return APIError(400, message, param=param, code=code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object for ``status``."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def describe_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Turn pydantic's error list into one readable message and the first offending parameter."""
    parts = []
    first_param = None
    for err in errors[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        # pydantic adds the union member name ('str', 'list[int]', ...) to the location; drop it.
        loc = [p for p in loc if not _looks_like_type_name(p)]
        param = ".".join(loc) or None
        first_param = first_param or param
        if err.get("type") == "json_invalid":
            parts.append(f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}")
            first_param = None
        elif err.get("type") == "missing":
            parts.append(f"'{param}' is required" if param else "a JSON request body (an object) is required")
        else:
            given = _short_repr(err.get("input"))
            parts.append(f"'{param or 'body'}': {err.get('msg')} (given {given})")
    if len(errors) > 5:
        parts.append(f"... and {len(errors) - 5} more errors")
    return "; ".join(parts) or "invalid request", first_param


def _looks_like_type_name(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "dict", "list"} or "[" in part or part.startswith(
        "function-"
    ) or part.endswith("-form") or (  # a tagged union's member (protocol.EmbeddingBody)
        part[:1].isupper() and part.endswith("Request") and part.isidentifier())  # a union of request bodies


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] | None = None) -> None:
    """Route every exception FastAPI can raise to an OpenAI error response (``on_error(status)`` counts it)."""

    def respond(error: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(error.status)
        return error.response()

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        return respond(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        return respond(APIError(exc.status_code, message, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        return respond(APIError(500, f"internal server error ({type(exc).__name__})"))
