"""HTTP side of the serving benchmark: streamed OpenAI requests, model discovery, the server's tokenizer."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from ninefold.bench.serve_datasets import BenchRequest
from ninefold.bench.serve_metrics import RequestResult
from ninefold.bench.serve_options import ENDPOINTS


def api_root(base_url: str) -> str:
    """The server root from ``--base-url``: ``http://h:p``, ``http://h:p/v1`` or an endpoint's full URL."""
    url = httpx.URL(base_url)
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"--base-url must be an http(s) URL like http://127.0.0.1:8000, got {base_url!r}")
    root = str(url).rstrip("/")
    for suffix in (*ENDPOINTS.values(), "/v1"):
        if root.endswith(suffix):
            return root[: -len(suffix)]
    return root


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def list_models(root: str, api_key: str | None, timeout_s: float = 30.0) -> list[str]:
    """Ids of the models the server serves (``GET /v1/models``)."""
    response = httpx.get(f"{root}/v1/models", headers=auth_headers(api_key), timeout=timeout_s)
    response.raise_for_status()
    return [entry["id"] for entry in response.json().get("data", [])]


class ServerTokenizer:
    """Counts tokens with the server's own tokenizer through ``POST /tokenize`` (vLLM's shape)."""

    name = "server /tokenize"

    def __init__(self, root: str, model: str, api_key: str | None, timeout_s: float = 30.0):
        self.url = f"{root}/tokenize"
        self.model = model
        self.http = httpx.Client(headers=auth_headers(api_key), timeout=timeout_s)

    def count(self, text: str) -> int:
        response = self.http.post(self.url, json={"model": self.model, "prompt": text})
        response.raise_for_status()
        data = response.json()
        return int(data["count"]) if "count" in data else len(data["tokens"])

    @classmethod
    def probe(cls, root: str, model: str, api_key: str | None) -> ServerTokenizer | None:
        """The tokenizer when the server answers ``/tokenize`` sensibly, else None."""
        tokenizer = cls(root, model, api_key)
        try:
            if tokenizer.count("hello world") > 0:
                return tokenizer
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass
        tokenizer.http.close()
        return None


@dataclass(frozen=True)
class StreamClient:
    """Sends one benchmark request as a streamed OpenAI completion and times every chunk (an embedding request:
    its end-to-end time)."""

    root: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    ignore_eos: bool = False

    def body(self, request: BenchRequest) -> dict:
        """The JSON body for one request (greedy, streamed, usage asked for; an embedding of the prompt)."""
        if self.endpoint == "embeddings":
            return {"model": self.model, "input": request.prompt, "encoding_format": "base64"}
        body: dict = {"model": self.model, "max_tokens": request.output_len, "temperature": 0.0, "stream": True,
                      "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def send(self, http: httpx.AsyncClient, request: BenchRequest, t0: float) -> tuple[RequestResult, str]:
        """Send ``request``; returns its timeline (seconds since ``t0``, a ``perf_counter`` value) and text.

        Never raises for a failed request: HTTP errors, SSE error events, broken streams and bad
        JSON all come back as an unsuccessful result with the reason in ``error``.
        """
        if self.endpoint == "embeddings":
            return await self._send_embedding(http, request, t0), ""
        start = time.perf_counter() - t0
        chunk_times: list[float] = []
        pieces: list[str] = []
        usage: dict | None = None
        error = ""
        try:
            async with http.stream(
                "POST", self.root + ENDPOINTS[self.endpoint], json=self.body(request), headers=auth_headers(self.api_key)
            ) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode("utf-8", "replace")
                    error = f"HTTP {response.status_code}: {detail[:300]}"
                else:
                    usage, error = await self._read_events(response, t0, chunk_times, pieces)
        except Exception as exc:  # every failure of one request is recorded, never raised
            error = f"{type(exc).__name__}: {exc}"[:300]
        end = time.perf_counter() - t0
        result = RequestResult(start=start, end=end, success=not error, chunk_times=chunk_times, error=error,
                               prompt_tokens=request.prompt_len, output_tokens=len(chunk_times),
                               token_source="chunks")
        if usage is not None:
            result.prompt_tokens = int(usage.get("prompt_tokens", request.prompt_len))
            result.output_tokens = int(usage.get("completion_tokens", len(chunk_times)))
            result.token_source = "usage"
        return result, "".join(pieces)

    async def _send_embedding(self, http: httpx.AsyncClient, request: BenchRequest, t0: float) -> RequestResult:
        """One embedding request: its end-to-end time and the prompt tokens the server counted (no output tokens)."""
        start = time.perf_counter() - t0
        error, prompt_tokens, source = "", request.prompt_len, "chunks"
        try:
            response = await http.post(self.root + ENDPOINTS["embeddings"], json=self.body(request),
                                       headers=auth_headers(self.api_key))
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {response.text[:300]}"
            else:
                reply = response.json()
                if not reply.get("data"):
                    error = f"no embedding in the reply: {response.text[:300]}"
                if reply.get("usage"):
                    prompt_tokens, source = int(reply["usage"].get("prompt_tokens", prompt_tokens)), "usage"
        except Exception as exc:  # recorded, never raised
            error = f"{type(exc).__name__}: {exc}"[:300]
        return RequestResult(start=start, end=time.perf_counter() - t0, success=not error, chunk_times=[],
                             error=error, prompt_tokens=prompt_tokens, output_tokens=0, token_source=source)

    async def _read_events(self, response: httpx.Response, t0: float, chunk_times: list[float],
                           pieces: list[str]) -> tuple[dict | None, str]:
        """Consume the SSE stream, timing each chunk with output text; returns ``(usage, error)``."""
        usage, event, seen = None, "", False
        async for line in response.aiter_lines():
            now = time.perf_counter() - t0
            if line.startswith("event:"):
                event = line[6:].strip()
            if not line.startswith("data:") or not (data := line[5:].strip()):
                continue
            seen = True
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if event == "error" or (isinstance(chunk, dict) and "error" in chunk):
                return usage, f"error event: {json.dumps(chunk.get('error', chunk))[:300]}"
            usage = chunk.get("usage") or usage
            text = "".join(self._chunk_text(choice) for choice in chunk.get("choices") or [])
            if text:
                chunk_times.append(now)
                pieces.append(text)
        if not seen:
            kind = response.headers.get("content-type", "no content-type")
            return usage, f"the response held no server-sent events ({kind}); does the server stream?"
        return usage, ""

    def _chunk_text(self, choice: dict) -> str:
        if self.endpoint == "chat":
            return (choice.get("delta") or {}).get("content") or ""
        return choice.get("text") or ""
