"""OpenAI-compatible HTTP server around ``AsyncEngine`` (FastAPI + uvicorn).

``build_app(engine, served_model_name=...)`` gives the ASGI app; ``run_server(app, host=, port=)``
serves it with a start-up banner and a draining SIGTERM. ``ninefold serve`` wires both to the CLI.
"""

from ninefold.llm.server.app import build_app
from ninefold.llm.server.serving import run as run_server

__all__ = ["build_app", "run_server"]
