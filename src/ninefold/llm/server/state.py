"""What every route of one server shares: the engine, its limits, metrics and admission."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ninefold.llm.server.admission import Admission
from ninefold.llm.server.errors import APIError
from ninefold.llm.server.logprobs import TokenTexts
from ninefold.llm.server.metrics import ServerMetrics
from ninefold.llm.server.preprocess import Limits


@dataclass
class ServerState:
    """Shared state of one running server."""

    engine: Any
    served_model_name: str
    limits: Limits
    metrics: ServerMetrics
    admission: Admission
    texts: TokenTexts
    defaults: Any = None  # SamplingParams from the model's generation_config, when the engine has them
    created: int = field(default_factory=lambda: int(time.time()))
    active: set = field(default_factory=set)  # Generation objects in flight
    tool_parser: str | None = None  # --tool-call-parser when auto tool choice is on
    reasoning_parser: str | None = None  # --reasoning-parser: reasoning split from the answer

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer."""
        return self.engine.tokenizer

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is the served name (or omitted)."""
        if model is not None and model != self.served_model_name:
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.served_model_name}'",
                param="model",
                code="model_not_found",
            )


def engine_limits(engine: Any, max_sequences: int | None) -> Limits:
    """Limits read from the engine: context length, vocabulary, KV-cache capacity."""
    stats = engine.stats()
    capacity = None
    if "num_blocks" in stats and "block_size" in stats:
        capacity = int(stats["num_blocks"]) * int(stats["block_size"])
    vocab = getattr(engine, "vocab_size", None) or engine.tokenizer.vocab_size  # the engine's check, so no 200 then error
    return Limits(
        max_model_len=int(engine.max_model_len),
        vocab_size=int(vocab),
        kv_capacity_tokens=capacity,
        max_sequences=max_sequences,
    )


def engine_defaults(engine: Any) -> Any:
    """The model's default SamplingParams (``default_sampling_params()`` of the engine), or None."""
    for owner in (engine, getattr(engine, "engine", None)):
        method = getattr(owner, "default_sampling_params", None)
        if callable(method):
            return method()
    return None
