"""ninefold.llm: LLM serving on top of ``ninefold.ops`` and ``ninefold.runtime``.

User surface (mirrors vLLM): ``LLM`` (``api.py``), ``SamplingParams`` (``sampling.py``),
``PoolingParams`` (``pooling.py``), ``LoRARequest`` (``lora/``), ``RequestOutput`` / ``CompletionOutput`` / ``EmbeddingRequestOutput``
(``outputs.py``), ``AsyncEngine`` (``async_engine.py``).

Inside, one job per module: ``loader.py`` (HF directories, GGUF via ``gguf.py``, known names via
``hub.py``, dummy weights) -> ``config.py`` (``ModelConfig``) -> ``models/llama.py`` (the decoder);
``tokenizer.py`` + ``detokenizer.py``; ``kv_cache.py`` (``BlockManager``, prefix cache) ->
``scheduler.py`` (continuous batching) -> ``runner.py`` (+ ``cuda_graphs.py``, ``sampler.py``) ->
``engine.py`` (``LLMEngine.step``); ``embedding.py`` + ``pooling.py`` (embeddings: cache-free packed steps,
pooled); ``lora/`` (PEFT adapters: read and checked, held in device slots, their deltas added per row);
``server/`` (OpenAI-compatible HTTP server).
"""
