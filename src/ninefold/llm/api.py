"""``LLM``: offline batched generation (mirrors vLLM's ``LLM`` class)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import replace

from tqdm.auto import tqdm

from ninefold.llm.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    round_sampling_params,
    whole_request_params,
)
from ninefold.llm.engine import LLMEngine
from ninefold.llm.lora import LoRARequest
from ninefold.llm.outputs import EmbeddingRequestOutput, RequestOutput
from ninefold.llm.pooling import PoolingParams
from ninefold.llm.sampling import SamplingParams


class LLM:
    """Load a model and generate for many prompts at once.

    ``model``: a Hugging Face directory, a ``.gguf`` file, a known model name or None (the
    default model); with ``load_format="dummy"`` also a shape name such as ``"llama-3.1-8b"``.
    Other keywords are ``EngineConfig`` fields (``max_num_seqs``, ``block_size``, ...).
    """

    def __init__(self, model=None, dtype="auto", device=None, **engine_args):
        self.engine = LLMEngine(model, dtype=dtype, device=device, **engine_args)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop what the engine started outside this process (tensor-parallel workers); also on ``with`` exit."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts=None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        prompt_token_ids: list[list[int]] | None = None,
        use_tqdm: bool = False,
        priority: list[int] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a str, a token-id list, or vLLM's ``{"prompt": str}`` /
        ``{"prompt_token_ids": [...]}`` dicts; one or a list of them); outputs in prompt order.
        ``priority``: one per prompt, for an engine with ``scheduling_policy="priority"`` (lower first).
        ``lora_request``: a LoRA adapter for every prompt, or one (or None) per prompt (``enable_lora=True``)."""
        items = _prompt_list(prompts, prompt_token_ids)
        adapters = _per_prompt(lora_request, len(items))
        if priority is not None and (not isinstance(priority, (list, tuple)) or len(priority) != len(items)):
            raise ValueError(f"priority: expected a list of {len(items)} ints (one per prompt), got {priority!r}")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(items):
                raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(items)} prompts")
            params = sampling_params
        else:
            params = [sampling_params or self.engine.default_sampling_params()] * len(items)
        engine = self.engine
        ranks = priority if priority is not None else [0] * len(items)
        requests = [engine.build_request(p, sp, priority=r, lora_request=a)  # every request checked first
                    for p, sp, r, a in zip(items, params, ranks, adapters)]
        for request in requests:
            engine.add_request(request)
        order = {r.request_id: i for i, r in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * len(requests)
        engine.stream_outputs = False
        try:
            with tqdm(total=len(requests), disable=not use_tqdm, desc="generating") as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            results[order[out.request_id]] = out
                            bar.update(1)
        finally:
            engine.stream_outputs = True
            for request in requests:
                engine.abort_request(request.request_id)
        return results

    def beam_search(
        self,
        prompts,
        params: BeamSearchParams,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """The ``params.beam_width`` best continuations of every prompt by beam search (``ninefold.llm.beam_search``;
        vLLM's algorithm and score), in prompt order. ``prompts``: the forms ``generate`` takes; ``lora_request``:
        one adapter for all or one per prompt; ``concurrency_limit``: search at most that many prompts at once
        (all by default). Each round batches one token of every live beam; the prefix cache keeps a round's
        cost to the beams' newest tokens."""
        whole = whole_request_params(params)
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool)
                                              or not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit: got {concurrency_limit!r}; expected an integer >= 1 or None")
        items = _prompt_list(prompts, None)
        adapters = _per_prompt(lora_request, len(items))
        engine = self.engine
        checked = [engine.build_request(p, whole, lora_request=a) for p, a in zip(items, adapters)]
        searches = [BeamSearch(r.prompt_token_ids, params, engine.eos_token_ids, engine.max_model_len)
                    for r in checked]
        round_params = round_sampling_params(params, engine.model_config.vocab_size)
        width = concurrency_limit or max(len(searches), 1)
        with tqdm(total=len(searches), disable=not use_tqdm, desc="beam search") as bar:
            for start in range(0, len(searches), width):
                group = list(zip(searches[start:start + width], adapters[start:start + width]))
                rounds = 0
                while any(not s.done for s, _ in group):
                    rounds += 1
                    bar.set_postfix_str(f"round {rounds} of at most {params.max_tokens}", refresh=rounds % 8 == 1)
                    live = [(s, a, beam) for s, a in group for beam in s.beams]
                    outs = self.generate(prompt_token_ids=[beam.tokens for _, _, beam in live],
                                         sampling_params=round_params, lora_request=[a for _, a, _ in live])
                    answers: dict[int, list] = {}
                    for (search, _, _), out in zip(live, outs):
                        answers.setdefault(id(search), []).append(out.outputs[0].logprobs[0])
                    for search, _ in group:
                        if not search.done:
                            search.take_round(answers[id(search)])
                bar.update(len(group))
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return [search.result(decode) for search in searches]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             lora_request: LoRARequest | None = None, **kwargs) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the model's chat template (``continue_final_message``:
        continue the last message instead of starting a new turn; it needs ``add_generation_prompt=False``)."""
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not conversations:
            return []
        ids = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt, tokenize=True,
                                                  continue_final_message=continue_final_message, **kwargs)
               for c in conversations]
        return self.generate(prompt_token_ids=ids, sampling_params=sampling_params, lora_request=lora_request)

    def embed(
        self,
        prompts=None,
        pooling_params: PoolingParams | list[PoolingParams] | None = None,
        *,
        prompt_token_ids: list[list[int]] | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (the same prompt forms as ``generate``), in prompt order: the model's final
        hidden states pooled as its files say (``ninefold.llm.pooling``; last token and normalized by default).
        ``truncate_prompt_tokens`` applies to every prompt whose ``PoolingParams`` leave it unset;
        ``lora_request``: an adapter for every prompt, or one (or None) per prompt (``enable_lora=True``)."""
        items = _prompt_list(prompts, prompt_token_ids)
        params = pooling_params
        if truncate_prompt_tokens is not None:
            params = [p if not isinstance(p, PoolingParams) or p.truncate_prompt_tokens is not None
                      else replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                      for p in (params if isinstance(params, list) else [params or PoolingParams()] * len(items))]
        embedder = self.engine.embedder
        requests = embedder.build_requests(items, params, lora_request=lora_request)
        outputs = []
        with tqdm(total=len(requests), disable=not use_tqdm, desc="embedding") as bar:
            for batch in embedder.batches(requests):
                outputs += embedder.run_batch(batch)
                bar.update(len(batch))
        return outputs


def _per_prompt(lora_request, count: int) -> list:
    """One adapter (or None) per prompt from one for all or a list of them."""
    if isinstance(lora_request, list):
        if len(lora_request) != count:
            raise ValueError(f"lora_request: {len(lora_request)} given for {count} prompts")
        return lora_request
    return [lora_request] * count


def _prompt_list(prompts, prompt_token_ids) -> list:
    """The batch of prompts (an empty list gives an empty batch, as in vLLM)."""
    if prompts is not None and prompt_token_ids is not None:
        raise ValueError("prompts: give either prompts or prompt_token_ids, not both")
    if prompt_token_ids is not None:
        if not isinstance(prompt_token_ids, list):
            raise TypeError(f"prompt_token_ids: expected a list of token-id lists, got "
                            f"{type(prompt_token_ids).__name__}")
        if prompt_token_ids and all(isinstance(t, int) for t in prompt_token_ids):
            return [prompt_token_ids]
        return list(prompt_token_ids)
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, SequenceABC) and not isinstance(prompts, (bytes, bytearray)):
        if prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]
        return list(prompts)
    raise TypeError(f"prompts: expected a str, a dict, or a list of str, dicts or token-id lists, "
                    f"got {type(prompts).__name__}")
