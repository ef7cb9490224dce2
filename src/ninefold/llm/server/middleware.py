"""Pure ASGI middleware: API-key check and request-body size limit.

Pure ASGI (not BaseHTTPMiddleware) so that ``receive`` keeps reporting client disconnects.
"""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ninefold.llm.server.errors import APIError

PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on the API routes (compared in constant time)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIXES):
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        if not hmac.compare_digest(given, self.expected):
            error = APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answers 413 for a request body over ``max_bytes`` (declared or streamed)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._too_large().response()(scope, receive, send)
                    return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI re-raises HTTPExceptions from body reading; the error handler makes it JSON.
                    raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"request body too large: the limit is {self.max_bytes} bytes",
                        code="request_too_large")
