"""Running the app under uvicorn: start-up banner, SIGTERM/SIGINT drain, engine shutdown."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from ninefold.llm.server.engine import DEFAULT_SERVED_NAME
from ninefold.llm.server.errors import APIError
from ninefold.llm.server.state import ServerState

logger = logging.getLogger("ninefold.server")


def banner(engine: Any, state: ServerState, url: str) -> str:
    """The start-up summary: model, dtype, device, KV cache, context, embedding pooling and URL."""
    stats = engine.stats()
    kv = "unknown"
    if "num_blocks" in stats:
        block = stats.get("block_size")
        kv = f"{stats['num_blocks']} blocks" + (f" x {block} tokens" if block else "")
        if state.limits.kv_capacity_tokens:
            kv += f" = {state.limits.kv_capacity_tokens} tokens"
    model = str(getattr(engine, "model_name", "?"))
    if model == "default":
        model = f"{DEFAULT_SERVED_NAME} (the default model)"
    rows = [
        ("model", f"{model} (served as '{state.served_model_name}')"),
        ("dtype", str(getattr(engine, "dtype", "?")).replace("torch.", "")),
        ("device", str(getattr(engine, "device", "?"))),
        ("KV cache", kv),
        ("context", f"{state.limits.max_model_len} tokens"),
        ("admits", "no limit" if state.admission.capacity is None else f"{state.admission.capacity} sequences"),
        ("URL", url),
    ]
    inner = getattr(engine, "engine", None)
    if inner is not None and not inner.model_config.has_lm_head:
        rows.insert(1, ("serves", "embeddings only (/v1/embeddings): the checkpoint has no output layer"))
    else:
        pooler = getattr(getattr(inner, "embedder", None), "pooler", None)
        if pooler is not None:
            rows.insert(-1, ("embeddings", f"{pooler.pooling_type} pooling ({pooler.source})"))
    slots = getattr(inner, "lora_slots", None)
    if slots is not None:
        served = ", ".join(f"'{name}'" for name in state.loras) or "none yet"
        rows.insert(1, ("LoRA", f"{served}; {slots.max_loras} per step, rank <= {slots.max_rank}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(["ninefold OpenAI-compatible server"] + [f"  {k.ljust(width)}  {v}" for k, v in rows])


class _DrainingServer(uvicorn.Server):
    """uvicorn server whose first SIGTERM/SIGINT drains instead of stopping at once (exit code 0)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self._drain_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it at exit and turn 0 into -15.
        if self._drain_task is not None or self._loop is None:
            self.force_exit = self.should_exit  # a second signal during the final stop forces it
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        admission = self.state.admission
        admission.draining = True
        logger.info("draining: %d sequences in flight, deadline %.1f s", admission.in_use, self.drain_timeout_s)
        deadline = time.monotonic() + self.drain_timeout_s
        while admission.in_use and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if admission.in_use:
            logger.warning("drain deadline passed: ending %d sequences", admission.in_use)
            for gen in list(self.state.active):
                gen.fail(APIError(503, "the server shut down before this request finished",
                                  headers={"Retry-After": "1"}))
            grace = time.monotonic() + 5.0
            while admission.in_use and time.monotonic() < grace:
                await asyncio.sleep(0.05)
        self.should_exit = True


def run(app: FastAPI, *, host: str, port: int, drain_timeout_s: float = 30.0, log_level: str = "info") -> int:
    """Serve ``app`` until SIGTERM/SIGINT, drain, shut the engine down; returns the exit code."""
    state: ServerState = app.state.server
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            lifespan="off", access_log=False)
    server = _DrainingServer(config, state, drain_timeout_s)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"
    print(banner(state.engine, state, url), file=sys.stderr, flush=True)
    if host not in ("127.0.0.1", "localhost", "::1") and not app.state.api_key_set:
        print(f"warning: listening on {host} without --api-key: anyone who can reach this port can use it",
              file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        shutdown = getattr(state.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
    return 0 if server.started else 1



