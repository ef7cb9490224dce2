"""What every route of one server shares: the engine, its limits, metrics and admission."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ninefold.llm.lora import LoRARequest
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
    loras: dict[str, LoRARequest] = field(default_factory=dict)  # adapters served under their own names
    _lora_ids: Any = field(default_factory=lambda: itertools.count(1))
    _lora_lock: Any = field(default_factory=threading.Lock)  # loads run on worker threads

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer."""
        return self.engine.tokenizer

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names, None for the served model (or none named); 404 for any other name."""
        if model is None or model == self.served_model_name:
            return None
        lora = self.loras.get(model)
        if lora is None:
            served = ", ".join(repr(n) for n in (self.served_model_name, *self.loras))
            raise APIError(404, f"The model '{model}' does not exist; this server serves {served}", param="model",
                           code="model_not_found")
        return lora

    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter in ``path`` as model ``name`` (its files read and checked now); 400 if it cannot be."""
        with self._lora_lock:
            if name == self.served_model_name or name in self.loras:
                raise APIError(400, f"The model name '{name}' is already served", param="lora_name")
            lora = LoRARequest(name, next(self._lora_ids), path)
            try:
                self.engine.engine.prepare_lora(lora)
            except ValueError as e:
                raise APIError(400, str(e), param="lora_path") from None
            self.loras[name] = lora
            return lora

    def remove_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` (requests already running finish with it); 404 if it is not served."""
        lora = self.loras.pop(name, None)
        if lora is None:
            raise APIError(404, f"The LoRA adapter '{name}' is not loaded", param="lora_name", code="model_not_found")
        self.engine.engine.lora_slots.forget(lora.lora_int_id)


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
