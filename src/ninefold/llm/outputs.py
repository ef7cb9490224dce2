"""Result types of ``LLM.generate`` / ``LLM.embed`` and ``AsyncEngine.generate`` / ``AsyncEngine.embed`` (mirror vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``n`` of them per request).

    ``logprobs``, when requested, holds one dict per generated token mapping token id to its
    log-probability (the top-N tokens plus the sampled one). ``finish_reason`` is None while
    running, then ``"stop"`` (EOS, stop token or stop string), ``"length"`` or ``"abort"``;
    ``stop_reason`` is the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """True once the sequence has a finish reason."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its ``CompletionOutput`` list (cumulative).

    ``prompt_logprobs`` (when ``SamplingParams.prompt_logprobs`` is set): one entry per prompt token,
    ``None`` for the first, else a dict token id -> log-probability holding the prompt token and the
    top-N tokens at its position.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    lora_request: Any = None  # the request's ``LoRARequest``, if it named an adapter


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (``embedding``: float values; ``hidden_size``: how many)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """The result of one ``LLM.embed`` prompt (mirrors vLLM's)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
