"""``LLMEngine``: requests in, ``RequestOutput``s out, one ``step()`` at a time.

A step schedules sequences (``Scheduler``), runs them (``ModelRunner``) and appends the sampled
tokens, checking stop conditions and detokenizing incrementally. Bad requests are refused in
``build_request`` with a ValueError naming what is wrong, before they touch engine state.
"""

from __future__ import annotations

import gc
import itertools
import threading
import time
import warnings

import torch

from ninefold.llm.config import (
    KV_CACHE_DTYPES,
    ModelConfig,
    resolve_dtype,
    rope_fingerprint,
    split_engine_args,
)
from ninefold.llm.detokenizer import IncrementalDetokenizer
from ninefold.llm.embedding import Embedder
from ninefold.llm.guided import Guide, TokenMasks
from ninefold.llm.kv_cache import BlockManager
from ninefold.llm.loader import load_checkpoint
from ninefold.llm.lora import LoRARequest, LoRASlots
from ninefold.llm.models import model_class
from ninefold.llm.outputs import CompletionOutput, RequestOutput
from ninefold.llm.pooling import pooler_config
from ninefold.llm.runner import ModelRunner
from ninefold.llm.sampler import Sampler
from ninefold.llm.sampling import SamplingParams, prompt_tokens_kept
from ninefold.llm.scheduler import Scheduler
from ninefold.llm.sequence import Request, Sequence, Status
from ninefold.llm.speculative import NgramProposer, SpeculativeConfig, accepted_count
from ninefold.llm.token_bytes import vocabulary_bytes
from ninefold.llm.tokenizer import Tokenizer, read_tokenizer_dir
from ninefold.runtime import Device, KVCachePool
from ninefold.runtime.kv_pool import bytes_per_block

CPU_KV_BYTES = 1 << 30  # default KV budget on CPUs, where "free memory" is shared with everything


def _check_ops_build(cfg, device: torch.device) -> None:
    """Say before loading anything when the trimmed build in ``NINEFOLD_OPS_BUILD`` keeps no implementation of an
    operator this engine's quantization calls (an error), or holds no paged kernels for its block size or KV cache
    dtype: an error where the build says ``uncovered = "error"`` (every such call would fail), else a warning (they
    compile on first use)."""
    from ninefold.ops import build

    active = build.active()
    if active is None:
        return
    missing = active.missing_for(cfg.quantization)
    if missing is not None:
        raise ValueError(f"quantization: {cfg.quantization!r} runs ops.{missing}, which NINEFOLD_OPS_BUILD="
                         f"{active.path} does not keep; add [ops.{missing}] to the manifest and rebuild with "
                         f"`ninefold ops build`")
    if device.type != "cuda":
        return
    gap = active.engine_gap(cfg.block_size, cfg.kv_cache_dtype)
    if gap is None:
        return
    message = (f"NINEFOLD_OPS_BUILD={active.path} holds no paged attention or cache kernels for this engine's {gap}; "
               f"add it to the manifest's block_sizes / kv_cache_dtypes and rebuild with `ninefold ops build`")
    if active.uncovered == "error":
        raise ValueError(message + ", or start the engine with what the build holds")
    warnings.warn(message + "; until then they compile on first use", stacklevel=3)


class LLMEngine:
    """The serving engine for one model on one device. Keyword arguments: ``EngineConfig`` fields."""

    def __init__(self, model=None, **engine_args):
        self.config = cfg = split_engine_args(engine_args)
        self.model_name = str(model) if model is not None and not isinstance(model, dict) else "default"
        self.device = torch.device(cfg.device) if cfg.device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        _check_ops_build(cfg, self.device)
        # tensor parallelism: rank 0 reads only its slices (a model that cannot be split is refused here)
        ckpt = load_checkpoint(model, cfg.load_format, quantization=cfg.quantization,
                               tensor_parallel=(0, cfg.tensor_parallel_size) if cfg.tensor_parallel_size > 1 else None,
                               read_tokenizer=cfg.tokenizer is None)
        if cfg.tokenizer is not None:  # vLLM's --tokenizer: the text side from elsewhere, the weights from the model
            ckpt.tokenizer, ckpt.tokenizer_config = read_tokenizer_dir(cfg.tokenizer)
        self.model_config = mc = ModelConfig.from_dict(ckpt.config)
        self.dtype = resolve_dtype(cfg.dtype, default=_default_dtype(ckpt.config, self.device))
        self.kv_dtype = KV_CACHE_DTYPES[cfg.kv_cache_dtype] or self.dtype  # what the KV cache holds
        self.tokenizer = Tokenizer(ckpt.tokenizer, ckpt.tokenizer_config) if ckpt.tokenizer is not None else None
        limit = mc.max_position_embeddings
        if mc.sliding_window:
            limit = min(limit, mc.sliding_window)  # no sliding-window attention: stay exact
        if cfg.max_model_len is not None and cfg.max_model_len > limit:
            raise ValueError(f"max_model_len: got {cfg.max_model_len}; this model supports at most {limit}")
        max_len = cfg.max_model_len or limit
        self.rope_fingerprint = rope_fingerprint(mc, max_len)  # what cached keys were rotated with (KV transfer)
        self.parallel_group = None
        self._memory_before_load = Device(self.device).allocated_bytes()  # what gpu_memory_utilization leaves out
        if cfg.tensor_parallel_size > 1:
            try:
                self.model = self._start_parallel(model, ckpt, max_len)
            except BaseException:
                self.close()
                raise
        else:
            self.model = model_class(mc.architecture)(
                mc, ckpt.tensors, dtype=self.dtype, device=self.device, max_positions=max_len, seed=cfg.seed)
        ckpt.tensors = None
        self.embedder = Embedder(self, pooler_config(ckpt.config, ckpt.source, cfg.pooling_type))
        try:
            self._build_serving_state(ckpt, max_len)
        except BaseException:  # the caller gets no engine to close: stop a tensor-parallel group's workers now
            self.close()
            raise

    def _build_serving_state(self, ckpt, max_len: int) -> None:
        """The KV cache, scheduler, runner and step state, around the loaded model."""
        cfg, mc = self.config, self.model_config
        self.lora_slots = None
        if cfg.enable_lora:  # before the KV pool, which takes what memory is left
            parallel = {}
            if self.parallel_group is not None:  # rank 0's slices; the workers get theirs from it
                from ninefold.llm.parallel import shard_plan

                parallel = {"plan": shard_plan(mc, 0, cfg.tensor_parallel_size), "mirror": self.model}
            self.lora_slots = LoRASlots(mc, dtype=self._lora_slots_dtype(), device=self.device,
                                        max_loras=cfg.max_loras, max_rank=cfg.max_lora_rank,
                                        max_cpu_loras=cfg.max_cpu_loras, **parallel)
        self.pool = self._make_pool(max_len)
        self.cache_config = self._cache_config()  # (fixed from here on; stats() hands it out every call)
        # a model without an output layer only embeds, in steps that read no cache: its context is the rotary table's
        self.max_model_len = min(max_len, self.pool.num_blocks * cfg.block_size) if mc.has_lm_head else max_len
        self._fit_rope_to_context()
        self.eos_token_ids = _eos_ids(mc, ckpt.generation_config, self.tokenizer)
        self.generation_config = dict(ckpt.generation_config)
        self.blocks = BlockManager(self.pool, enable_prefix_caching=cfg.enable_prefix_caching,
                                   reuse_partial_blocks=self.parallel_group is None)
        self.speculative = SpeculativeConfig.parse(cfg.speculative_config)
        if self.speculative is not None and getattr(self.model, "rope_in_attention", False):
            # the decode graphs also replay draft steps, whose rows read keys other rows write in the same layer
            self.model.rope_in_attention = False
        self.num_draft_tokens = self.num_accepted_tokens = 0
        self.scheduler = Scheduler(
            self.blocks, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            propose=NgramProposer(self.speculative, self.max_model_len) if self.speculative else None,
            policy=cfg.scheduling_policy, lora_slots=self.lora_slots)
        self.runner = ModelRunner(
            self.model, self.pool, Sampler(self.device, mc.vocab_size, self.eos_token_ids),
            max_model_len=self.max_model_len,
            # tensor parallelism: the workers follow rank 0's calls one by one, so no decode graphs yet
            enforce_eager=cfg.enforce_eager or self.parallel_group is not None or not mc.has_lm_head,
            cuda_graph_max_batch=self._graph_max_batch(), lora_slots=self.lora_slots,
        )
        if self.device.type == "cuda" and mc.has_lm_head:
            self._warm_up_prefill()
            # Weights, graphs, compiled kernels and caches built so far live as long as the engine:
            # moved out of the collector's generations, a collection during a step scans only what
            # the step allocated (GPU steps are short enough for a full scan to show).
            gc.collect()
            gc.freeze()
        self.requests: dict[str, Request] = {}
        self.stream_outputs = True
        self.async_scheduling = cfg.async_scheduling if cfg.async_scheduling is not None else self.device.type == "cuda"
        self._in_flight = None  # a launched step whose tokens are not read yet (async_scheduling)
        self.num_steps_ahead = 0  # steps launched before the previous one's tokens were read
        self._auto_ids = itertools.count()
        self._guided_masks: TokenMasks | None = None
        self._guided_indexing: threading.Thread | None = None

    def _start_parallel(self, model, ckpt, max_len: int):
        """Rank 0's slice of the model, with the workers holding the other slices started and loaded."""
        from ninefold.llm.parallel import ParallelModel, WorkerGroup, build_rank_model, check_parallel_size

        cfg, mc = self.config, self.model_config
        check_parallel_size(mc, cfg.tensor_parallel_size)
        group = WorkerGroup(cfg.tensor_parallel_size, self.device)
        self.parallel_group = group
        # the workers read what rank 0 read: the resolved file or directory (dummy weights: the shape asked for)
        source = model if ckpt.tensors is None else ckpt.source
        lora = None
        if cfg.enable_lora:
            lora = {"max_loras": cfg.max_loras, "max_rank": cfg.max_lora_rank, "dtype": self._lora_slots_dtype()}
        group.setup(model=source, load_format=cfg.load_format, quantization=cfg.quantization, dtype=self.dtype,
                    max_positions=max_len, seed=cfg.seed, block_size=cfg.block_size, lora=lora,
                    kv_dtype=self.kv_dtype)
        rank_model, error = None, None
        try:
            rank_model = build_rank_model(mc, ckpt.tensors, group.parallel, dtype=self.dtype, device=self.device,
                                          max_positions=max_len, seed=cfg.seed,
                                          sliced=ckpt.tensor_parallel is not None)
        except Exception as e:
            error = e
        group.agree_loaded(error)
        return ParallelModel(rank_model, group)

    def close(self) -> None:
        """Release what outlives the Python objects: a tensor-parallel engine's worker processes. Idempotent."""
        if self.parallel_group is not None:
            self.parallel_group.shutdown()

    def _fit_rope_to_context(self) -> None:
        """A KV pool smaller than the configured context caps the sequences; longrope's factors follow that cap
        (a Phi-3.5 engine whose pool holds at most 4096 tokens runs the short factors, as transformers does for
        sequences that short). Before any graph is captured; under tensor parallelism on every rank."""
        capped = rope_fingerprint(self.model_config, self.max_model_len)
        if capped == self.rope_fingerprint:
            return
        self.model.fit_rope(self.max_model_len)
        self.rope_fingerprint = capped

    def _make_pool(self, max_len: int) -> KVCachePool:
        cfg, mc = self.config, self.model.config  # the model's: one rank's heads under tensor parallelism
        args = (mc.num_layers, mc.num_kv_heads, mc.head_dim, cfg.block_size, self.kv_dtype, self.device)
        if cfg.num_kv_blocks is not None:
            return KVCachePool(*args, cfg.num_kv_blocks)
        if not self.model_config.has_lm_head:  # embeddings only: their steps write no cache slot
            return KVCachePool(*args, 1)
        if self.device.type == "cpu":
            per_block = bytes_per_block(*args[:5])
            wanted = -(-max_len * min(cfg.max_num_seqs, 8) // cfg.block_size)
            return KVCachePool(*args, max(1, min(wanted, CPU_KV_BYTES // per_block)))
        if cfg.gpu_memory_utilization is not None:
            held = Device(self.device).allocated_bytes() - self._memory_before_load
            sizing = {"instance_fraction": cfg.gpu_memory_utilization, "instance_used_bytes": max(0, held)}
        else:
            sizing = {"memory_fraction": cfg.kv_cache_memory_fraction or 0.9}
        return KVCachePool.from_memory(*args, **sizing, profile_fn=self._profile_forward,
                                       reserved_bytes=(1 << 30) + self._lora_graph_bytes())

    def _graph_max_batch(self) -> int:
        """The largest batch the decode graphs are captured for."""
        return min(self.config.cuda_graph_max_batch, self.config.max_num_seqs)

    def _lora_slots_dtype(self) -> torch.dtype:
        # float32 on CPUs: the native decode step reads them as they are (adapters are small)
        return torch.float32 if self.device.type == "cpu" else self.dtype

    def _lora_graph_bytes(self) -> int:
        """What the adapters' decode graphs keep beyond the base graphs: their logits at every captured size (their
        other activations share the base graphs' pool)."""
        from ninefold.llm.cuda_graphs import capture_sizes

        cfg = self.config
        if (self.lora_slots is None or cfg.enforce_eager or self.device.type != "cuda"
                or self.parallel_group is not None):  # (tensor-parallel engines capture no graphs)
            return 0
        rows = sum(capture_sizes(self._graph_max_batch()))
        return rows * self.model_config.vocab_size * self.dtype.itemsize

    @torch.inference_mode()
    def _profile_forward(self) -> None:
        """The activation peak: the largest prefill step plus the largest batch of logits."""
        cfg = self.config
        self.model.bind_scratch_kv_cache(cfg.block_size)
        self._packed_prefill(cfg.max_num_batched_tokens, logits_rows=cfg.max_num_seqs)
        self.model.kv_caches = []

    def _packed_prefill(self, num_tokens: int, logits_rows: int = 1, prompt_len: int | None = None) -> None:
        """A prefill step of ``num_tokens`` tokens writing no cache slot, packed as prompts of
        ``prompt_len`` tokens (``None``: a single prompt). No prompt is longer than the rotary table
        (max_model_len): more tokens are packed as several."""
        from ninefold.llm.models.llama import AttentionMetadata

        dev, T = self.device, num_tokens
        L = min(T, self.model.cos_sin.shape[0], prompt_len or T)
        cu = torch.tensor([*range(0, T, L), T], dtype=torch.int32, device=dev)
        meta = AttentionMetadata(slot_mapping=torch.full((T,), -1, dtype=torch.int64, device=dev),
                                 cu_seqlens_q=cu, cu_seqlens_k=cu, use_cache=False, max_seqlen_q=L, max_seqlen_k=L)
        ids = torch.zeros(T, dtype=torch.int64, device=dev)
        hidden = self.model.forward(ids, torch.arange(T, device=dev) % L, meta)
        self.model.compute_logits(hidden[:logits_rows])

    @torch.inference_mode()
    def _warm_up_prefill(self) -> None:
        """Compile, before the first request, the prefill kernels a run would otherwise compile
        while requests wait: short, medium and long chunks over cached context, full-budget steps whose
        token count is not a multiple of the kernels' tiles or of 16 (Triton and the DSL specialise on
        both; the activation profile ran the budget itself, decode sizes are compiled by the graph
        capture), and full-budget steps of short and medium prompts. The prefill attention chooses its
        tiles by the mean new tokens per prompt (``ninefold.ops.triton.prefill``: up to 64, up to 1024,
        more), so each class runs here, packed and over cached context, within the rotary table and the
        step budget."""
        from ninefold.llm.models.llama import AttentionMetadata

        dev, bs = self.device, self.config.block_size
        cu = lambda *v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
        rows = self.model.cos_sin.shape[0]
        budget = self.config.max_num_batched_tokens
        for new in sorted(n for n in {min(n, rows - bs, budget) for n in (16, 128, 2048)} if n > 0):
            width = -(-(bs + new) // bs)
            meta = AttentionMetadata(slot_mapping=torch.full((new,), -1, dtype=torch.int64, device=dev),
                                     block_tables=torch.zeros((1, width), dtype=torch.int32, device=dev),
                                     cu_seqlens_q=cu(0, new), cu_seqlens_k=cu(0, bs + new), use_cache=True,
                                     max_seqlen_q=new, max_seqlen_k=bs + new)
            hidden = self.model.forward(torch.zeros(new, dtype=torch.int64, device=dev),
                                        torch.arange(bs, bs + new, device=dev), meta)
            self.model.compute_logits(hidden[-1:])
        for tokens in sorted({budget - 1, budget - 16} - {budget}):
            if tokens > 1:
                self._packed_prefill(tokens)
        tokens = budget - 1
        for prompt_len in sorted(n for n in {min(p, rows, tokens) for p in (32, 512)} - {min(rows, tokens)} if n > 0):
            self._packed_prefill(tokens, prompt_len=prompt_len)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's ``generation_config.json`` defaults (used when none are given).

        ``do_sample: false`` means greedy; temperature, top_p, top_k, min_p and repetition_penalty are
        taken over. A value SamplingParams refuses is left out with a warning naming it; the others stay.
        """
        g = self.generation_config
        fields = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = g.get(name)
            if value is None:
                continue
            try:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"expected a number, got {type(value).__name__}")
                SamplingParams(**{name: value})
            except ValueError as error:  # one odd value should not refuse every request, nor drop the rest
                warnings.warn(f"generation_config.json: {name}={value!r} ignored ({error})", stacklevel=2)
                continue
            fields[name] = value
        if g.get("do_sample") is False:
            fields["temperature"] = 0.0
        return SamplingParams(**fields)

    # -- requests ---------------------------------------------------------------------------------

    def build_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                      priority: int = 0, lora_request: LoRARequest | None = None) -> Request:
        """Check and tokenize one request (touches no engine state). Raises ValueError/TypeError.

        ``priority``: under ``scheduling_policy="priority"``, lower values are admitted and kept first.
        ``lora_request``: generate with that LoRA adapter (an engine built with ``enable_lora=True``); its files
        are read and checked here, after everything else."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority: expected an int, got {type(priority).__name__}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority: got {priority}, but the engine schedules first come first served; start "
                             "it with scheduling_policy='priority' (--scheduling-policy priority)")
        if not self.model_config.has_lm_head:
            raise ValueError("model: this checkpoint holds the decoder without its output layer (lm_head), as "
                             "embedding models are saved; it computes embeddings (LLM.embed, /v1/embeddings), not text")
        params = self.default_sampling_params() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._auto_ids)) if request_id is None else str(request_id)
        text, ids = self.prompt_token_ids(prompt, prompt_tokens_kept(params.truncate_prompt_tokens, self.max_model_len))
        vocab = self.model_config.vocab_size
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens; max_model_len is {self.max_model_len}, which leaves "
                             "no room for output")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > vocab:
                raise ValueError(f"{name}: got {getattr(params, name)}; this model has {vocab} tokens")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias: token id {max(params.logit_bias)} out of the vocabulary range [0, {vocab})")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab:
            raise ValueError(f"allowed_token_ids: token id {max(params.allowed_token_ids)} out of the vocabulary "
                             f"range [0, {vocab})")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop: this model has no tokenizer, so its output has no text to find stop strings in; "
                             "use stop_token_ids")
        bad_words = self._bad_word_ids(params.bad_words) if params.bad_words else None
        machine = None
        if params.guided_decoding is not None:
            if self.tokenizer is None:
                raise ValueError("guided_decoding: this model has no tokenizer, so its tokens' bytes are unknown")
            if params.min_tokens:  # its bans could leave a format nothing to continue with
                raise ValueError(f"min_tokens: got {params.min_tokens} with guided_decoding; expected 0 (a guided "
                                 "output ends where its format does)")
            machine = params.guided_decoding.machine()
        total = min(len(ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        if self.blocks.blocks_for(total) > self.pool.num_blocks:
            raise ValueError(f"max_tokens: prompt ({len(ids)}) + max_tokens needs {self.blocks.blocks_for(total)} KV "
                             f"blocks, the cache has {self.pool.num_blocks}")
        adapter = self.prepare_lora(lora_request) if lora_request is not None else None
        seqs = []
        for i in range(params.n):
            seq = Sequence(request_id, i, list(ids), len(ids), params, bad_words=bad_words, priority=priority,
                           lora=lora_request, lora_adapter=adapter, max_num_tokens=total)
            if params.seed is not None:
                seq.seed = (params.seed + 1_000_003 * i) % 2**63
                seq.generator = torch.Generator(device=self.device)
            if params.logprobs is not None:
                seq.logprobs = []
            if params.guided_decoding is not None:
                seq.guide = Guide(machine, self._token_masks(), () if params.ignore_eos else self.eos_token_ids)
            if params.prompt_logprobs is not None and i == 0:  # the request's n sequences share one prompt
                seq.prompt_logprobs = [None]
            if self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop_strings, include_stop_str_in_output=params.include_stop_str_in_output)
            seqs.append(seq)
        return Request(request_id, text, list(ids), params, seqs, arrival=time.monotonic(), priority=priority,
                       lora_request=lora_request)

    def prepare_lora(self, lora_request: LoRARequest):
        """Read and check a LoRA adapter (once per ``lora_int_id``), ValueError/TypeError naming what is wrong."""
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request: expected a LoRARequest, got {type(lora_request).__name__}")
        if self.lora_slots is None:
            raise ValueError(f"lora_request: adapter {lora_request.lora_name!r} asked for, but this engine was built "
                             "without LoRA support; start it with enable_lora=True (--enable-lora)")
        return self.lora_slots.prepare(lora_request)

    def prompt_token_ids(self, prompt, keep: int | None = None) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt: a str (tokenized), a list of token ids, or vLLM's prompt dict;
        ``keep``: only the last ``keep`` tokens. Raises TypeError/ValueError naming what is wrong."""
        prompt = _unwrap_prompt_dict(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids (a list of int)")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise TypeError(f"prompt: expected a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt: empty (0 tokens); at least one token is needed")
        if keep is not None:
            ids = ids[-keep:]
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token id(s) {bad[:5]} out of the vocabulary range [0, {vocab})")
        return text, ids

    def _bad_word_ids(self, words: list[str]) -> list[tuple[int, ...]]:
        """The token sequences of ``bad_words``: each word without leading whitespace, alone and after a space
        (as vLLM does)."""
        if self.tokenizer is None:
            raise ValueError("bad_words: this model has no tokenizer, so the words cannot be turned into tokens")
        sequences = set()
        for word in words:
            for variant in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids:
                    sequences.add(tuple(ids))
        return sorted(sequences)

    def _token_masks(self) -> TokenMasks:
        """The vocabulary's index and mask cache for guided decoding (built on the first guided request, unless
        ``index_vocabulary`` started it earlier)."""
        if self._guided_indexing is not None:
            self._guided_indexing.join()
        if self._guided_masks is None:
            self._index_vocabulary()
        return self._guided_masks

    def _index_vocabulary(self) -> None:
        size = self.model_config.vocab_size
        self._guided_masks = TokenMasks(vocabulary_bytes(self.tokenizer, size, exclude=self.eos_token_ids), size)

    def index_vocabulary(self) -> None:
        """Index the vocabulary for guided decoding in a background thread now (a server does so at start, so
        that its first guided request does not hold up the steps of every other request; about 0.5 s for a
        49k-token vocabulary on a CPU core)."""
        if self.tokenizer is None or self._guided_masks is not None or self._guided_indexing is not None:
            return
        self._guided_indexing = threading.Thread(target=self._index_vocabulary, name="ninefold-vocab-index",
                                                 daemon=True)
        self._guided_indexing.start()

    def add_request(self, request: Request) -> None:
        """Queue a request from ``build_request``; its id must be new."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its KV blocks now; unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.finished:
                seq.drop_placeholder()
                self.scheduler.finish(seq, "abort")
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._in_flight is not None

    # -- stepping ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of requests that changed (only finished ones when
        ``stream_outputs`` is False).

        With ``async_scheduling`` a step's tokens are read one call later: each call launches the
        next step before reading the tokens of the one in flight, so the host's work (scheduling,
        inputs, stop checks, outputs) overlaps the device's.
        """
        previous, self._in_flight = self._in_flight, None
        if previous is None:
            launched = self._launch(None)
            if launched is None:
                return []
            if self.async_scheduling and self._may_run_ahead(launched):
                self._in_flight = launched
                return []
            return self._complete(launched)
        try:
            ahead = self._launch(previous) if self._may_run_ahead(previous) else None
        except BaseException:
            self._in_flight = previous  # still to be read: a retry (or sync) completes it
            raise
        self.num_steps_ahead += ahead is not None
        outputs = self._complete(previous)
        self._in_flight = ahead
        return outputs

    def sync(self) -> list[RequestOutput]:
        """Finish the step in flight, if any (``async_scheduling``); returns its outputs."""
        previous, self._in_flight = self._in_flight, None
        return self._complete(previous) if previous is not None else []

    def _may_run_ahead(self, launched) -> bool:
        """Whether the next step may be scheduled before ``launched``'s tokens are read."""
        if self.speculative is not None:  # drafts follow from the last token, and how many were accepted
            return False
        if launched.tokens is None:
            return True
        if launched.tokens.read_back:  # logprobs were asked for: already read
            return False
        # Penalties and bad words read every earlier token on the host; a guide's mask follows from the last token.
        return not any(seq.penalized or seq.guide is not None or seq.bad_words for seq in launched.samplers)

    def _launch(self, previous):
        """Schedule and enqueue a step; ``previous``: the step in flight, whose tokens are not read yet."""
        if previous is not None:
            for row, seq in enumerate(previous.samplers):
                if seq.status is Status.RUNNING and len(seq.token_ids) + 1 < seq.max_num_tokens:
                    seq.add_placeholder(row)
        try:
            step = self.scheduler.schedule()
            launched = self.runner.launch(step, previous) if step else None
        except BaseException:  # nothing was enqueued: leave the sequences as they were, for a retry
            self.scheduler.unlaunch()
            if previous is not None:
                for seq in previous.samplers:
                    # A sequence the failed schedule preempted keeps its placeholder: its token is still
                    # in flight, and the scheduler admits it again only once that token is read.
                    if seq.status is Status.RUNNING:
                        seq.drop_placeholder()
            raise
        for s in step:  # counted at launch: the next step is scheduled before this one's tokens are read
            s.seq.num_computed_tokens += s.num_new_tokens - len(s.draft_ids)  # drafts: once accepted
        return launched

    def _complete(self, launched) -> list[RequestOutput]:
        """Read ``launched``'s tokens and append them, checking stop conditions."""
        sampled = launched.read()
        touched: dict[str, Request] = {}
        tokens, logprobs = sampled.token_ids, sampled.logprobs
        commit = self.blocks.commit if self.blocks.enable_prefix_caching else None
        j = 0
        for s in launched.step:
            seq = s.seq
            if s.samples:
                rows = s.num_sampled_rows
                j += rows
                if seq.status is Status.FINISHED:  # ended (stop, abort) while this step was in flight
                    continue
                if s.draft_ids:
                    self._append_speculated(s, tokens[j - rows : j], logprobs[j - rows : j], commit)
                else:
                    self._append(seq, tokens[j - 1], logprobs[j - 1], commit)
                if self.stream_outputs or seq.status is Status.FINISHED:
                    touched[seq.request_id] = self.requests[seq.request_id]
            elif commit is not None and seq.status is not Status.FINISHED:
                commit(seq)
        outputs = []
        for request in touched.values():
            if request.finished:
                del self.requests[request.request_id]
                outputs.append(self._output(request))
            elif self.stream_outputs:
                outputs.append(self._output(request))
        return outputs

    def _append_speculated(self, s, tokens: list[int], logprobs: list, commit) -> None:
        """Append the drafts of ``s`` that the model's ``tokens`` confirm, then its token after them."""
        seq = s.seq
        accepted = accepted_count(s.draft_ids, tokens)
        self.num_draft_tokens += len(s.draft_ids)
        self.num_accepted_tokens += accepted
        for m in range(accepted + 1):
            # the step computed the key and value of the token before this one (an accepted draft)
            seq.num_computed_tokens = s.start + 1 + m
            self._append(seq, tokens[m], logprobs[m], commit)
            if seq.status is Status.FINISHED:
                return

    def _append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, commit=None) -> None:
        seq.append(token)
        if commit is not None:  # after the token: it may fill a placeholder inside a computed block
            commit(seq)
        p = seq.params
        if logprobs is not None and seq.logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token]
        n_out = len(seq.output_ids)
        may_stop = n_out >= p.min_tokens
        eos = may_stop and not p.ignore_eos and token in self.eos_token_ids
        stop_token = may_stop and not eos and bool(p.stop_token_ids) and token in p.stop_token_ids
        guided_done = seq.guide is not None and not (eos or stop_token) and self._guide_accepts(seq, token)
        # A token that stops the sequence stays in token_ids but is not rendered (as in vLLM), unless asked for.
        rendered = not (eos or stop_token) or p.include_stop_str_in_output
        stop_string = (seq.detokenizer.add([token], check_stop=may_stop and not (eos or stop_token))
                       if seq.detokenizer and rendered else None)
        if eos:
            self.scheduler.finish(seq, "stop")
        elif stop_token:
            self.scheduler.finish(seq, "stop", token)
        elif stop_string is not None:
            self.scheduler.finish(seq, "stop", stop_string)
        elif guided_done:  # the JSON object is complete
            self.scheduler.finish(seq, "stop")
        elif len(seq.token_ids) >= seq.max_num_tokens:
            self.scheduler.finish(seq, "length")

    @staticmethod
    def _guide_accepts(seq: Sequence, token: int) -> bool:
        """Advance ``seq``'s guide; True when its output is complete. A token the guide cannot take (only
        where the vocabulary cannot spell the rest of a choice and the model has no end-of-sequence token)
        ends that sequence rather than the step of every other."""
        try:
            return seq.guide.accept(token)
        except RuntimeError as error:
            warnings.warn(f"request {seq.request_id}: {error}; its output ends here", stacklevel=3)
            return True

    def _output(self, request: Request) -> RequestOutput:
        # Snapshots: a streamed output must not change after it is handed out. Copying L ids is a
        # memcpy (about a microsecond per thousand), far below the step itself.
        outs = []
        for seq in request.seqs:
            text = seq.detokenizer.visible_text(seq.finished) if seq.detokenizer else ""
            outs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=list(seq.output_ids),
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outs,
                             finished=request.finished,
                             num_cached_tokens=max(s.num_cached_tokens or 0 for s in request.seqs),
                             prompt_logprobs=_copy(request.seqs[0].prompt_logprobs),
                             lora_request=request.lora_request)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (rows of its embedding): token ids are ``[0, vocab_size)``."""
        return self.model_config.vocab_size

    def stats(self) -> dict:
        """Scheduler and KV-cache figures for metrics (with LoRA: the adapters of running and waiting sequences)."""
        lora = {}
        if self.lora_slots is not None:  # (copies taken under the GIL: the engine thread changes the queues)
            running, waiting = tuple(self.scheduler.running), tuple(self.scheduler.waiting)
            lora = {"lora": {"max_lora": self.lora_slots.max_loras,
                             "running": sorted({s.lora.lora_name for s in running if s.lora is not None}),
                             "waiting": sorted({s.lora.lora_name for s in waiting if s.lora is not None})}}
        return {**lora,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_usage": 1.0 - self.blocks.num_available / self.pool.num_blocks,
            "num_free_blocks": self.blocks.num_available,
            "num_blocks": self.pool.num_blocks,
            "block_size": self.config.block_size,
            "prefix_cache_hit_rate": self.blocks.hit_rate,
            "prefix_cache_queries": self.blocks.queried_tokens,
            "prefix_cache_hits": self.blocks.hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "cache_config": self.cache_config,
        }

    def _cache_config(self) -> dict[str, str]:
        """The KV cache's settings as vLLM's ``cache_config_info`` labels them (strings; as vLLM, the device's
        blocks are ``num_gpu_blocks`` on any device and ``num_cpu_blocks`` the host blocks swapped to)."""
        cfg = self.config
        return {"block_size": str(cfg.block_size), "cache_dtype": str(self.kv_dtype).removeprefix("torch."),
                "enable_prefix_caching": str(cfg.enable_prefix_caching),
                "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
                "kv_cache_memory_fraction": str(cfg.kv_cache_memory_fraction),
                "num_gpu_blocks": str(self.pool.num_blocks), "num_cpu_blocks": str(self.pool.num_host_blocks)}


def _unwrap_prompt_dict(prompt):
    """vLLM's prompt dicts: ``{"prompt": text}`` or ``{"prompt_token_ids": ids}`` (exactly one key)."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], (list, tuple)):
        return prompt["prompt_token_ids"]
    raise TypeError(f"prompt: a dict must be {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}, "
                    f"got keys {sorted(map(str, keys))}")


def _copy(values: list | None) -> list | None:
    return None if values is None else list(values)


def _default_dtype(config: dict, device: torch.device) -> torch.dtype:
    if device.type == "cpu":
        return torch.float32
    stored = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return torch.float16 if stored == "float16" else torch.bfloat16


def _eos_ids(mc: ModelConfig, generation_config: dict, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    ids = list(mc.eos_token_ids)
    eos = generation_config.get("eos_token_id")
    ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))
