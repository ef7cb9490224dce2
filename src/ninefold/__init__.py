"""ninefold: one AI system stack for CPUs and GPUs.

Layers (imports point down only): ``ninefold.llm`` -> ``ninefold.ops`` / ``ninefold.comm`` ->
``ninefold.runtime``; ``ninefold.ops`` -> ``ninefold.dsl``. The engine's user surface is exported
lazily here so that ``import ninefold.dsl`` stays light.
"""

import os as _os

__version__ = "0.1.0"

# Every ninefold kernel was tuned and checked with Triton fusing multiplies and adds (FMA), its default through
# 3.9; 3.10 turns that default off (3.9 warns about it). Unless the process chose, it stays on.
_os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

_LAZY = {
    "LLM": "ninefold.llm.api",
    "SamplingParams": "ninefold.llm.sampling",
    "PoolingParams": "ninefold.llm.pooling",
    "LoRARequest": "ninefold.llm.lora.request",
    "GuidedDecodingParams": "ninefold.llm.guided",
    "StructuredOutputsParams": "ninefold.llm.guided",
    "RequestOutput": "ninefold.llm.outputs",
    "CompletionOutput": "ninefold.llm.outputs",
    "EmbeddingRequestOutput": "ninefold.llm.outputs",
    "BeamSearchParams": "ninefold.llm.beam_search",
    "BeamSearchOutput": "ninefold.llm.beam_search",
    "BeamSearchSequence": "ninefold.llm.beam_search",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ninefold' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
