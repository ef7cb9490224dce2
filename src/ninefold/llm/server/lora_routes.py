"""Serving LoRA adapters under their own model names: the adapters given at start, and vLLM's routes that load
and unload them while the server runs (only when asked for: they read any path the server can reach)."""

from __future__ import annotations

import anyio
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ninefold.llm.server.errors import APIError
from ninefold.llm.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from ninefold.llm.server.state import ServerState


def add_start_adapters(state: ServerState, lora_modules: dict[str, str]) -> None:
    """Serve each ``name -> path`` adapter; ValueError naming the first one that cannot be served."""
    if lora_modules and getattr(state.engine.engine, "lora_slots", None) is None:
        raise ValueError("lora_modules: adapters were given, but the engine was built without enable_lora=True "
                         "(--enable-lora)")
    for name, path in lora_modules.items():
        try:
            state.add_lora(name, path)
        except APIError as e:
            raise ValueError(f"lora_modules: {name}={path}: {e.message}") from None


def install_runtime_updates(app: FastAPI, state: ServerState) -> None:
    """``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> JSONResponse:
        """Serve the PEFT adapter in ``lora_path`` as model ``lora_name`` (400 if it does not fit the model)."""
        await anyio.to_thread.run_sync(state.add_lora, body.lora_name, body.lora_path)  # reads files
        return JSONResponse({"status": "ok", "message": f"LoRA adapter '{body.lora_name}' loaded"})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> JSONResponse:
        """Stop serving adapter ``lora_name``; requests already running on it finish."""
        state.remove_lora(body.lora_name)
        return JSONResponse({"status": "ok", "message": f"LoRA adapter '{body.lora_name}' unloaded"})
