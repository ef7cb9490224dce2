"""Guided decoding: constrain sampling so the output follows a format (``SamplingParams.guided_decoding``).

Supported: ``json_object`` (OpenAI's ``response_format={"type": "json_object"}``): the output is one
JSON object; the sequence ends (finish reason ``"stop"``) the moment the object is complete, or at
``max_tokens`` with a prefix of one. Each step masks the logits of the tokens whose bytes cannot
continue the object (``masks.TokenMasks``), after penalties and ``logit_bias``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninefold.llm.guided import json_machine
from ninefold.llm.guided.masks import TokenMasks

__all__ = ["GuidedDecodingParams", "JsonObjectGuide", "TokenMasks"]


@dataclass(frozen=True)
class GuidedDecodingParams:
    """What the output must follow (vLLM's name). ``json_object=True``: one JSON object."""

    json_object: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ValueError(f"guided_decoding.json_object: got {self.json_object!r}; expected True or False")
        if not self.json_object:
            raise ValueError("guided_decoding: nothing to follow; set json_object=True (the one format supported)")


class JsonObjectGuide:
    """One sequence's progress through a JSON object: the recognizer state after its output so far."""

    def __init__(self, masks: TokenMasks):
        self.masks = masks
        self.state: tuple | None = json_machine.START

    @property
    def complete(self) -> bool:
        """Whether the output is one whole JSON object."""
        return json_machine.complete(self.state)

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; returns whether the object is now complete."""
        data = self.masks.vocab[token_id] if token_id < len(self.masks.vocab) else None
        state = json_machine.advance(self.state, data) if data else None
        if state is None:  # the mask allowed only tokens that continue the object
            raise RuntimeError(f"guided decoding: token {token_id} ({data!r}) cannot follow the output so far")
        self.state = state
        return self.complete

    def mask(self, device: torch.device) -> torch.Tensor:
        """Boolean ``[vocab]``: the tokens that may come next."""
        return self.masks.mask(self.state, device)
