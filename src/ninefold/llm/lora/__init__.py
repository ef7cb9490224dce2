"""LoRA adapters: requests that run the base model plus an adapter's low-rank deltas (vLLM's ``LoRARequest``)."""

from ninefold.llm.lora.adapter import Adapter, load_adapter
from ninefold.llm.lora.request import LoRARequest
from ninefold.llm.lora.slots import LoRASlots, LoRAStep

__all__ = ["Adapter", "LoRARequest", "LoRASlots", "LoRAStep", "load_adapter"]
