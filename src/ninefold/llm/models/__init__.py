"""Model definitions: architecture name -> class. One readable file per family."""

from __future__ import annotations

from ninefold.llm.config import SUPPORTED_ARCHITECTURES


def model_class(architecture: str):
    """The class that implements ``architecture`` (a HF ``architectures`` entry)."""
    if architecture in SUPPORTED_ARCHITECTURES:
        from ninefold.llm.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    raise ValueError(f"architecture: got {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
