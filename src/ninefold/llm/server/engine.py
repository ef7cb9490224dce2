"""Starting the AsyncEngine the server drives, and naming the model it serves."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def served_name(model: str | None) -> str:
    """The name clients use by default: the directory or file name (a config.json's directory), or the known model
    name."""
    if model is None:
        return DEFAULT_SERVED_NAME
    path = Path(model)
    if path.suffix == ".gguf":
        return path.stem
    if path.suffix == ".json" and path.parent.name:  # dummy weights of a bare config: name them by its directory
        return path.parent.name
    return path.name or str(model)


def start_engine(model: str | None, engine_args: dict[str, Any]) -> Any:
    """Build ``AsyncEngine(model, **engine_args)``; loading shows the engine's progress bar."""
    from ninefold.llm.async_engine import AsyncEngine

    print(f"loading {model or DEFAULT_SERVED_NAME} ...", file=sys.stderr, flush=True)
    engine = AsyncEngine(model, **engine_args)
    engine.engine.index_vocabulary()  # for guided decoding and tool calls, while the server starts
    return engine
