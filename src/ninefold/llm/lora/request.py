"""``LoRARequest``: which adapter a request runs with (vLLM's class, same fields and order)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request: a ``lora_name`` (what the server's ``model`` field names), a positive
    ``lora_int_id`` that identifies it inside the engine (prefix-cache entries and device slots are kept
    per id), and ``lora_path``, a directory in PEFT's format (``adapter_config.json`` and
    ``adapter_model.safetensors`` or ``adapter_model.bin``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name: got {self.lora_name!r}; expected a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id: got {self.lora_int_id!r}; expected an integer >= 1 "
                             "(0 stands for the base model)")
        if not isinstance(self.lora_path, (str, os.PathLike)) or not str(self.lora_path):
            raise ValueError(f"lora_request.lora_path: got {self.lora_path!r}; expected the adapter's directory")
        object.__setattr__(self, "lora_path", str(self.lora_path))
