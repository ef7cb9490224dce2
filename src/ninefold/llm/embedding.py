"""Embedding requests: prompts packed into cache-free forward passes, pooled per prompt.

An embedding needs the prompt's hidden states only, so its tokens go through the model once, packed
with other prompts (no padding) into steps of at most ``max_num_batched_tokens`` tokens that write no KV
cache slot. A prompt must fit one step and the rotary table; ``truncate_prompt_tokens`` shortens longer
ones. A prompt may name a LoRA adapter (``LLM.embed(..., lora_request=...)``): a step holds at most
``max_loras`` adapters, each in a slot for the length of the step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ninefold.llm.outputs import EmbeddingOutput, EmbeddingRequestOutput
from ninefold.llm.pooling import PoolerConfig, PoolingParams, pool


@dataclass
class EmbeddingRequest:
    """A checked, tokenized embedding request (``Embedder.build_request``)."""

    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: PoolingParams
    lora: Any = None  # a LoRARequest, or None for the base model
    lora_adapter: Any = None  # its adapter, read and checked when the request was built


class Embedder:
    """The embedding side of an ``LLMEngine``: ``build_requests`` checks, ``batches`` groups, ``run_batch`` computes."""

    def __init__(self, engine, pooler: PoolerConfig):
        self.engine = engine
        self.pooler = pooler
        self._ids = itertools.count()

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt one step embeds: the step budget, within the rotary table."""
        return min(self.engine.config.max_num_batched_tokens, self.engine.model.cos_sin.shape[0])

    def build_request(self, prompt, params: PoolingParams | None = None, request_id: str | None = None,
                      lora_request=None) -> EmbeddingRequest:
        """Check and tokenize one prompt (a str, token ids or vLLM's prompt dict); ValueError/TypeError if bad.
        ``lora_request``: embed with that adapter (an engine with ``enable_lora``)."""
        params = PoolingParams() if params is None else params
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params: expected PoolingParams, got {type(params).__name__}")
        self.pooler.check(params, self.engine.model_config.hidden_size)
        limit = self.max_prompt_tokens
        keep = limit if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
        text, ids = self.engine.prompt_token_ids(prompt, keep)
        if len(ids) > limit:
            raise ValueError(
                f"prompt: {len(ids)} tokens; an embedding is computed in one step of at most {limit} tokens "
                f"(max_num_batched_tokens {self.engine.config.max_num_batched_tokens}, rotary table "
                f"{self.engine.model.cos_sin.shape[0]}); raise max_num_batched_tokens or set truncate_prompt_tokens")
        adapter = self.engine.prepare_lora(lora_request) if lora_request is not None else None
        rid = f"embd-{next(self._ids)}" if request_id is None else str(request_id)
        return EmbeddingRequest(rid, text, ids, params, lora_request, adapter)

    def build_requests(self, prompts: list, pooling_params: PoolingParams | list[PoolingParams] | None = None,
                       request_id: str | None = None, lora_request=None) -> list[EmbeddingRequest]:
        """``build_request`` for every prompt, all checked before any is returned; ``pooling_params`` and
        ``lora_request``: one for all or one per prompt; ``request_id``: the prefix of the requests' ids
        (``{request_id}-{i}``)."""
        params = pooling_params if isinstance(pooling_params, list) else [pooling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"pooling_params: {len(params)} given for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: {len(loras)} given for {len(prompts)} prompts")
        return [self.build_request(p, pp, None if request_id is None else f"{request_id}-{i}", lora)
                for i, (p, pp, lora) in enumerate(zip(prompts, params, loras))]

    def batches(self, requests: list[EmbeddingRequest]) -> Iterator[list[EmbeddingRequest]]:
        """``requests`` in order, grouped into steps of at most ``max_num_batched_tokens`` tokens (and of at most
        ``max_loras`` adapters)."""
        budget, batch, tokens = self.engine.config.max_num_batched_tokens, [], 0
        adapters: set[int] = set()
        for request in requests:
            new = request.lora is not None and request.lora.lora_int_id not in adapters
            if batch and (tokens + len(request.token_ids) > budget
                          or (new and len(adapters) == self.engine.config.max_loras)):
                yield batch
                batch, tokens, adapters = [], 0, set()
            batch.append(request)
            tokens += len(request.token_ids)
            if request.lora is not None:
                adapters.add(request.lora.lora_int_id)
        if batch:
            yield batch

    @torch.inference_mode()
    def run_batch(self, batch: list[EmbeddingRequest]) -> list[EmbeddingRequestOutput]:
        """One forward pass over the packed prompts of ``batch`` (built by ``batches``)."""
        from ninefold.llm.models.llama import AttentionMetadata

        dev = self.engine.device
        lengths = [len(r.token_ids) for r in batch]
        total = sum(lengths)
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=dev)
        meta = AttentionMetadata(slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=dev),
                                 cu_seqlens_q=cu, cu_seqlens_k=cu, use_cache=False,
                                 max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
        ids = torch.tensor([t for r in batch for t in r.token_ids], dtype=torch.int64, device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lengths])
        held = self._hold_slots(batch)
        try:
            if held:
                rows = torch.tensor([held.get(r.lora.lora_int_id) if r.lora is not None else -1 for r in batch],
                                    dtype=torch.int64).repeat_interleave(torch.tensor(lengths))
                lora = self.engine.lora_slots.step(rows.to(dev))
                hidden = self.engine.model.forward(ids, positions, meta, lora=lora)
            else:
                hidden = self.engine.model.forward(ids, positions, meta)
        finally:
            for slot in held.values():
                self.engine.lora_slots.release(slot)
        vectors = pool(hidden, cu, self.pooler.pooling_type).cpu()  # one copy to the host for the whole step
        outputs = []
        for request, vector in zip(batch, vectors):
            values = self.pooler.finish(vector[None], request.params)[0].tolist()
            outputs.append(EmbeddingRequestOutput(request.request_id, EmbeddingOutput(values), request.token_ids))
        return outputs

    def _hold_slots(self, batch: list[EmbeddingRequest]) -> dict[int, int]:
        """A device slot for each adapter of ``batch`` (lora_int_id -> slot), held until ``release``."""
        held: dict[int, int] = {}
        for request in batch:
            if request.lora is None or request.lora.lora_int_id in held:
                continue
            slot = self.engine.lora_slots.acquire(request.lora.lora_int_id, request.lora_adapter)
            if slot is None:
                for taken in held.values():
                    self.engine.lora_slots.release(taken)
                raise RuntimeError("embed: every LoRA slot holds an adapter that running requests use")
            held[request.lora.lora_int_id] = slot
        return held
