"""A small but real OpenAI-compatible HTTP server for benchmark tests (FastAPI + uvicorn on 127.0.0.1).

It stands in for "any OpenAI-compatible server": it streams server-sent events in OpenAI's chunk
format from /v1/completions and /v1/chat/completions, lists its model, tokenizes (a word of L
characters is ceil(L/4) tokens), and can leave out usage or /tokenize like some servers do.
Output token i is the text " t{i}" (one token by its own tokenizer), one per chunk unless
``tokens_per_chunk`` says otherwise. A prompt holding the word ``REJECT`` gets an HTTP 400, one
holding ``BREAK`` an error object in the stream after its first token, one holding ``EVENT`` an SSE
``event: error`` there, and one holding ``PLAIN`` a non-streamed JSON answer. It counts requests
in flight.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "stand-in-model"


def count_tokens(text: str) -> int:
    return sum(math.ceil(len(word) / 4) for word in text.split())


@dataclass
class StandInOptions:
    first_token_delay_s: float = 0.01
    token_delay_s: float = 0.002
    tokens_per_chunk: int = 1
    send_usage: bool = True
    serve_tokenize: bool = True
    api_key: str | None = None


@dataclass
class StandInState:
    in_flight: int = 0
    max_in_flight: int = 0
    bodies: list[dict] = field(default_factory=list)
    received_at: list[float] = field(default_factory=list)


def build_app(options: StandInOptions, state: StandInState) -> FastAPI:
    app = FastAPI()

    def unauthorized(request: Request) -> JSONResponse | None:
        if options.api_key and request.headers.get("authorization") != f"Bearer {options.api_key}":
            return JSONResponse({"error": {"message": "bad key", "type": "auth", "param": None, "code": 401}}, 401)
        return None

    @app.get("/v1/models")
    async def models(request: Request):
        return unauthorized(request) or {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        if not options.serve_tokenize:
            return JSONResponse({"detail": "Not Found"}, 404)
        prompt = (await request.json())["prompt"]
        n = count_tokens(prompt)
        return {"count": n, "tokens": list(range(n)), "max_model_len": 4096}

    async def generate(request: Request, chat: bool):
        denied = unauthorized(request)
        if denied:
            return denied
        body = await request.json()
        state.bodies.append(body)
        state.received_at.append(time.perf_counter())
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if "REJECT" in prompt.split():
            error = {"message": "rejected on purpose", "type": "invalid_request_error", "param": "prompt", "code": 400}
            return JSONResponse({"error": error}, 400)
        if "PLAIN" in prompt.split():  # answers as if stream=false had been asked
            return {"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                    "choices": [{"index": 0, "text": " t0", "finish_reason": "length"}]}
        max_tokens = body["max_tokens"]
        stream_id, obj = ("chatcmpl-1", "chat.completion.chunk") if chat else ("cmpl-1", "text_completion")

        def chunk(text: str | None, finish: str | None = None, usage: dict | None = None) -> str:
            if text is None:
                choices = []
            elif chat:
                choices = [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]
            else:
                choices = [{"index": 0, "text": text, "finish_reason": finish}]
            payload = {"id": stream_id, "object": obj, "model": MODEL, "choices": choices, "usage": usage}
            return f"data: {json.dumps(payload)}\n\n"

        async def events():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                if chat:
                    role = {"id": stream_id, "object": obj, "model": MODEL,
                            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                    yield f"data: {json.dumps(role)}\n\n"
                await asyncio.sleep(options.first_token_delay_s)
                for first in range(0, max_tokens, options.tokens_per_chunk):
                    if first > 0:
                        await asyncio.sleep(options.token_delay_s)
                        if "BREAK" in prompt.split():
                            yield 'data: {"error": {"message": "broke on purpose", "code": 500}}\n\n'
                            return
                        if "EVENT" in prompt.split():
                            yield 'event: error\ndata: {"message": "named error event"}\n\n'
                            return
                    last = min(first + options.tokens_per_chunk, max_tokens)
                    text = "".join(f" t{i}" for i in range(first, last))
                    yield chunk(text, "length" if last == max_tokens else None)
                if options.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                    usage = {"prompt_tokens": count_tokens(prompt), "completion_tokens": max_tokens,
                             "total_tokens": count_tokens(prompt) + max_tokens}
                    yield chunk(None, usage=usage)
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


class StandInServer:
    """Runs the stand-in in a background thread; ``url`` is its root. Use as a context manager."""

    def __init__(self, options: StandInOptions | None = None):
        self.options = options or StandInOptions()
        self.state = StandInState()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        config = uvicorn.Config(build_app(self.options, self.state), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> StandInServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("stand-in server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()
