"""An ASGI response for server-sent events that notices a disconnect right away.

Starlette's StreamingResponse (ASGI spec 2.4) only learns of a disconnect when a write fails, so a
request waiting in the queue or between tokens would keep its KV blocks. This response listens for
``http.disconnect`` while it streams and then closes the event iterator, whose ``finally`` aborts
the engine requests.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ninefold.llm.server.generation import wait_for_disconnect


class EventStreamResponse(Response):
    """``text/event-stream`` body from an async iterator of already formatted events.

    ``on_close`` runs once the response is over, however it ended.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None] | None = None,
                 status_code: int = 200) -> None:
        super().__init__(content=None, status_code=status_code)
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]

        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            async with anyio.create_task_group() as group:

                async def run_then_cancel(func) -> None:
                    with contextlib.suppress(OSError):
                        await func()
                    group.cancel_scope.cancel()

                group.start_soon(run_then_cancel, pump)
                await run_then_cancel(lambda: wait_for_disconnect(receive))
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.events, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
            # Runs even when the client left before the first event (then the iterator never started).
            if self.on_close is not None:
                self.on_close()
