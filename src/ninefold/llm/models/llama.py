"""The Llama-family decoder, read top to bottom: Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3, Phi-3.

Variants are switches of ``ModelConfig``: q/k/v bias (Qwen2), RMSNorm on q and k per head
(Qwen3), tied embeddings, grouped-query attention, llama3 rope scaling. Every layer calls
``ninefold.ops``; the paged KV cache comes from a ``KVCachePool``. q/k/v and gate/up weights are
concatenated at load time so each is one matmul.

Shapes: T tokens of a step packed together (no padding), D hidden size, Hq / Hk query / key-value
heads of dim Dh.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ninefold import ops
from ninefold.llm.config import ModelConfig, rope_cos_sin_cache, rotary_head_order, rotary_rows
from ninefold.llm.gguf_packed import (
    QUANTIZED,
    GGUFRows,
    PackedLinear,
    QuantizedEmbedding,
    embed_rows,
    packed_linear,
)
from ninefold.llm.models import llama_cpu
from ninefold.ops import cpu_native, cpu_upcast
from ninefold.runtime.memory import WeightStore

# Steps of at most this many tokens call the fused norm/activation + linear operators (decode steps of few
# sequences, where ops.triton's GEMVs fuse them; elsewhere the operators run the unfused pair).
FUSED_MAX_ROWS = 32
# "auto" keeps a dense copy of packed layer matrices for prefill while it costs at most this.
DENSE_COPY_BUDGET = 2 << 30
# Quantized embedding tables stay quantized where ``LlamaModel._table_stays_quantized`` says so (tests turn it off).
KEEP_TABLES_QUANTIZED = True


@dataclass
class AttentionMetadata:
    """How the tokens of one step map to sequences and cache slots.

    ``slot_mapping`` [T] int64: the cache slot each new token's key/value is written to.
    Decode steps (one token per sequence) set ``context_lens`` [B] int32. Other steps set
    ``cu_seqlens_q`` / ``cu_seqlens_k`` [B+1] int32; ``use_cache`` says whether earlier tokens
    are read from the paged cache (some sequence has context computed in an earlier step).
    ``block_tables`` [B, max_blocks] int32 in both cases.

    A mixed step may put ``num_decodes`` one-token sequences first: their tokens are the first
    ``num_decodes`` rows, their keys per sequence are ``decode_context_lens`` [num_decodes] and
    their block tables the first rows of ``block_tables``; ``cu_seqlens_q`` / ``cu_seqlens_k``,
    ``use_cache`` and ``max_seqlen_q`` / ``max_seqlen_k`` (host ints, the longest query and key
    lengths) then describe only the sequences after them.

    ``drafts``: a decode step whose rows include speculative draft rows, which read the keys and
    values the rows before them (of the same sequence) write in the same layer.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    use_cache: bool = True
    num_decodes: int = 0
    decode_context_lens: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    drafts: bool = False

    @property
    def is_decode(self) -> bool:
        """True for a pure decode step (one new token per sequence)."""
        return self.context_lens is not None


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor | PackedLinear | ops.Fp8Weight  # [(Hq + 2 Hk) Dh, D]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor | PackedLinear | ops.Fp8Weight  # [D, Hq Dh]
    post_norm: torch.Tensor
    gate_up: torch.Tensor | PackedLinear | ops.Fp8Weight  # [2 I, D]
    down: torch.Tensor | PackedLinear | ops.Fp8Weight  # [D, I]


class LlamaForCausalLM:
    """A Llama-family causal LM over a paged KV cache.

    GGUF matrices that arrive quantized (``gguf_packed.Int4Codes`` / ``Q8Codes``, see
    ``config.raw["ninefold_quantization"]``) become ``PackedLinear`` layers on ``ops.linear_int4``
    where that mode asks for it ("auto": on CPUs with bfloat16 support, packed GEMMs in bfloat16
    whatever the model's dtype, plus a dense copy in the model's dtype for prefill within
    ``DENSE_COPY_BUDGET``; "int4": on any device, packed only); otherwise they are dequantized.
    With "fp8" every layer's projection matrices become ``ops.Fp8Weight`` (``ops.linear_fp8``).
    """

    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor] | None,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        seed: int = 0,
        parallel=None,
    ):
        self.config = config
        # A tensor-parallel group (``ninefold.llm.parallel``): ``config`` and ``tensors`` are then this
        # rank's shard, an all-reduce follows the o and down projections, and only rank 0 has an output layer.
        self.parallel = parallel
        has_head = (parallel is None or parallel.rank == 0) and config.has_lm_head
        self.dtype, self.device = dtype, device
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        if tensors is None:
            tensors = random_weights(config, dtype, device, seed)
        take = _WeightReader(tensors)
        self._setup_packing(config)
        embed = take("model.embed_tokens.weight", (config.vocab_size, config.hidden_size))
        if (isinstance(embed, GGUFRows) and config.tie_word_embeddings
                and not self._table_stays_quantized(None)):  # decoded once for the table and the head
            embed = embed.with_dense(embed.dequantize(torch.float32))
        fused = {"embed": embed, "norm": take("model.norm.weight", (config.hidden_size,))}
        if config.tie_word_embeddings:
            fused["lm_head"] = self._matrix([embed], dense_copy=False, head=True)
        elif not has_head:
            pass
        elif "lm_head.weight" in tensors:
            fused["lm_head"] = self._matrix([take("lm_head.weight", (config.vocab_size, config.hidden_size))], head=True)
        else:
            raise ValueError("checkpoint: tensor 'lm_head.weight' is missing and tie_word_embeddings is false")
        if isinstance(embed, QUANTIZED) and self._table_stays_quantized(fused.get("lm_head")):
            fused["embed"] = QuantizedEmbedding(embed, dtype)
        elif isinstance(embed, QUANTIZED):
            fused["embed"] = embed.dequantize(torch.float32)
            if config.tie_word_embeddings and not isinstance(fused["lm_head"], PackedLinear):
                fused["lm_head"] = fused["embed"]
        for i in tqdm(range(config.num_layers), desc="loading weights", unit="layer", leave=False):
            fused.update(self._fused_layer(take, i))
        self.packed = {name: t for name, t in fused.items() if isinstance(t, (PackedLinear, ops.Fp8Weight))}
        self.tables = {name: t for name, t in fused.items() if isinstance(t, QuantizedEmbedding)}
        dense = {n: t for n, t in fused.items() if n not in self.packed and n not in self.tables}
        self.weights = WeightStore(dense, device, dtype=dtype)
        w = {**self.weights, **self.packed, **self.tables}
        self.embed, self.norm, self.lm_head = w["embed"], w["norm"], w.get("lm_head")
        if config.tie_word_embeddings and type(self.lm_head) is PackedLinear and self.dense_copies:
            self.lm_head.dense = self.embed  # batches of more rows read the embedding table itself
            self.lm_head.dense_shared = True
        self.layers = [
            LayerWeights(*(w.get(f"{i}.{name}") for name in LayerWeights.__dataclass_fields__))
            for i in range(config.num_layers)
        ]
        self.cos_sin = rope_cos_sin_cache(config, max_positions, device)
        # Not under tensor parallelism: the workers' steps do not carry AttentionMetadata.drafts.
        self.rope_in_attention = rope_in_attention_wanted(device) and parallel is None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._cpu_decoder = None
        # decode steps on CPUs run through llama_cpu.CpuDecoder (one fused step: no room for the all-reduces;
        # it reads dense or GGUF-packed matrices only)
        self.cpu_fast_decode = parallel is None and not self.fp8

    def _setup_packing(self, config: ModelConfig) -> None:
        mode = config.raw.get("ninefold_quantization", "none")
        self.fp8 = mode == "fp8"
        # torch's CPU int4 kernel is fast for bfloat16 activations only (float32/float16 take a
        # scalar path ~20x slower than a dense matmul): on CPUs with bfloat16 support the packed
        # GEMMs run in bfloat16 whatever the model's dtype (the rest of a float32 model stays float32).
        cpu_bf16 = self.device.type == "cpu" and _cpu_has_bf16()
        # CPUs without bfloat16 but with AVX-512 VNNI (Ice Lake, Cascade Lake) or AVX2 (Haswell and later,
        # Zen) pack for ops.cpu_native's kernels.
        cpu_blocks = self.device.type == "cpu" and not cpu_bf16 and mode == "auto" and cpu_native.fast()
        self.pack = mode == "int4" or (mode == "auto" and (cpu_bf16 or cpu_blocks))
        self.pack_blocks_only = cpu_blocks  # matrices the kernels cannot take: dense
        self.compute_dtype = torch.bfloat16 if cpu_bf16 else None
        c = config
        layer_elems = c.num_layers * c.hidden_size * (self.q_size + 2 * self.kv_size + self.q_size
                                                      + 3 * c.intermediate_size)
        # A dense copy serves prefill where it beats the blocks: float32 (oneDNN/MKL GEMM) or a half dtype torch
        # multiplies fast. Without such a GEMM (AVX2: ops/cpu_upcast.py converts the weight to float32 on every
        # call) the native blocks win at every row count: SmolLM2 in bfloat16 prefilled 512 tokens at 691 tok/s on
        # the blocks against 533 on the copy (docs/perf/cpu.md), and a Llama-3.2-1B-shaped model 32 tokens at
        # 13.6 tok/s on the copy.
        slow_half = (cpu_blocks and self.dtype in (torch.bfloat16, torch.float16)
                     and not cpu_upcast.native_half_gemm(self.dtype))
        self.dense_copies = mode == "auto" and not slow_half and layer_elems * self.dtype.itemsize <= DENSE_COPY_BUDGET

    def _table_stays_quantized(self, lm_head) -> bool:
        """Whether a quantized embedding table stays in its GGUF form (``QuantizedEmbedding``): on CPUs whose layers
        are packed without dense copies (models past ``DENSE_COPY_BUDGET``, half dtypes on AVX2), where the float
        table would be the largest tensor in memory; not where a tied output layer reads the table itself."""
        return (KEEP_TABLES_QUANTIZED and self.device.type == "cpu" and self.pack and not self.dense_copies
                and self.parallel is None and (lm_head is None or isinstance(lm_head, PackedLinear)))

    def _matrix(self, parts: list, dense_copy: bool = True, head: bool = False) -> torch.Tensor | PackedLinear:
        """Row-stacked ``parts``: a ``PackedLinear`` when they are quantized and packing is on, else dense.

        In a float32 model the native blocks round activations in two terms (``gguf_packed.packed_linear``) for
        the output layer, and for layer matrices that also keep a dense copy (whose packed calls are then
        only short prefill chunks); a layer matrix without one prefills on the blocks in one term, as the
        decode step and llama.cpp do, at half the work."""
        if self.fp8 and not head:  # from the checkpoint's own precision, on the device
            return ops.Fp8Weight.quantize(torch.cat([p.to(self.device) for p in parts]))
        if self.pack and all(isinstance(p, QUANTIZED) for p in parts):
            keep_dense = dense_copy and self.dense_copies
            packed = packed_linear(parts, self.device, self.dtype, keep_dense=keep_dense,
                                   compute_dtype=self.compute_dtype, blocks_only=self.pack_blocks_only,
                                   fine_activations=self.dtype == torch.float32 and (head or keep_dense))
            if packed is not None:
                return packed
        dense = [p.dequantize(torch.float32) if isinstance(p, QUANTIZED) else p for p in parts]
        return dense[0] if len(dense) == 1 else torch.cat(dense)

    def _fused_layer(self, take, i: int) -> dict[str, torch.Tensor | PackedLinear]:
        c, p = self.config, f"model.layers.{i}."
        D, Dh = c.hidden_size, c.head_dim
        if p + "self_attn.qkv_proj.weight" in take.tensors:  # Phi-3 stores q/k/v, and gate/up, already stacked
            qkv = [take(p + "self_attn.qkv_proj.weight", (self.q_size + 2 * self.kv_size, D))]
            gate_up = [take(p + "mlp.gate_up_proj.weight", (2 * c.intermediate_size, D))]
        else:
            qkv = [take(p + "self_attn.q_proj.weight", (self.q_size, D)),
                   take(p + "self_attn.k_proj.weight", (self.kv_size, D)),
                   take(p + "self_attn.v_proj.weight", (self.kv_size, D))]
            gate_up = [take(p + "mlp.gate_proj.weight", (c.intermediate_size, D)),
                       take(p + "mlp.up_proj.weight", (c.intermediate_size, D))]
        if rotary_head_order(c) is not None:  # a partial rotary embedding: q and k rows in the kernels' pair order
            qkv = self._rotary_ordered(qkv)
        out = {
            "input_norm": take(p + "input_layernorm.weight", (D,)),
            "qkv": self._matrix(qkv),
            "o": self._matrix([take(p + "self_attn.o_proj.weight", (D, self.q_size))]),
            "post_norm": take(p + "post_attention_layernorm.weight", (D,)),
            "gate_up": self._matrix(gate_up),
            "down": self._matrix([take(p + "mlp.down_proj.weight", (D, c.intermediate_size))]),
        }
        if c.attention_bias:
            q_bias, k_bias, v_bias = (take(p + f"self_attn.{n}_proj.bias", (size,))
                                      for n, size in (("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size)))
            out["qkv_bias"] = torch.cat([rotary_rows(q_bias, c), rotary_rows(k_bias, c), v_bias])
        if c.qk_norm:
            order = rotary_head_order(c) or slice(None)
            out["q_norm"] = take(p + "self_attn.q_norm.weight", (Dh,))[order]
            out["k_norm"] = take(p + "self_attn.k_norm.weight", (Dh,))[order]
        return {f"{i}.{name}": t for name, t in out.items()}

    def _rotary_ordered(self, qkv: list) -> list:
        """q/k/v weight parts (stacked in one, or three) as ``[q, k, v]`` parts with q's and k's rows in
        ``rotary_head_order`` (quantized GGUF parts reordered as they are: their blocks lie along rows)."""
        if len(qkv) == 1:  # stacked: the parts are row ranges of one matrix
            q, kv = self.q_size, self.kv_size
            parts = [(qkv[0], slice(0, q)), (qkv[0], slice(q, q + kv)), (qkv[0], slice(q + kv, None))]
        else:
            parts = [(t, slice(None)) for t in qkv]
        out = []
        for j, (t, rows) in enumerate(parts):
            def part(r, rows=rows, rotated=j < 2):
                return rotary_rows(r[rows], self.config) if rotated else r[rows]
            out.append(t.map_rows(part) if isinstance(t, QUANTIZED) else part(t))
        return out

    def bind_kv_cache(self, pool) -> None:
        """Use ``pool`` (a ``KVCachePool``) as this model's paged key/value storage."""
        self.kv_caches = [(pool.k_cache(i), pool.v_cache(i)) for i in range(self.config.num_layers)]

    def bind_scratch_kv_cache(self, block_size: int) -> None:
        """One block shared by every layer, for passes that write no cache slot and read no cached token
        (activation profiling; a tensor-parallel worker until rank 0 sends the real cache's size)."""
        c = self.config
        scratch = torch.zeros((1, block_size, c.num_kv_heads, c.head_dim), dtype=self.dtype, device=self.device)
        self.kv_caches = [(scratch, scratch)] * c.num_layers

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights (tied embeddings counted once; packed layers with their dense copies; quantized
        embedding tables as stored)."""
        return self.weights.nbytes + sum(p.nbytes for p in (*self.packed.values(), *self.tables.values()))

    def fit_rope(self, context: int) -> None:
        """Rebuild the rotary table (same rows) for sequences of at most ``context`` tokens: longrope picks its
        factors by the longest sequence the engine runs."""
        self.cos_sin = rope_cos_sin_cache(self.config, self.cos_sin.shape[0], self.cos_sin.device, context=context)
        self._cpu_decoder = None  # (it holds the old table's pointer)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                lora=None) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, D]``, for token ids and positions ``[T]``.

        ``lora``: a ``ninefold.llm.lora.LoRAStep`` adding the adapters' deltas to the projections of the rows
        that use one (such steps take the unfused path, or on CPUs the native decode step)."""
        if llama_cpu.supports(self, meta):
            if self._cpu_decoder is None:
                self._cpu_decoder = llama_cpu.CpuDecoder(self)
            if lora is None or self._cpu_decoder.native is not None:
                return self._cpu_decoder.forward(input_ids, positions, meta, lora)
        eps = self.config.rms_norm_eps
        hidden = embed_rows(self.embed, input_ids)
        # Up to 32 rows on a GPU (decode steps of few sequences): the norms run in the prologues of the
        # q/k/v and gate_up GEMVs and the SwiGLU gate in down's (ops.*_linear; one kernel each where a
        # GEMV applies, the unfused pair otherwise; FP8 layers too). Other shapes, GGUF-packed layers and the
        # CPU take the unfused path.
        fuse = (hidden.shape[0] <= FUSED_MAX_ROWS and hidden.is_cuda and (self.fp8 or not self.packed)
                and lora is None)
        residual = None
        for i, layer in enumerate(self.layers):
            if lora is not None:
                hidden, residual = self._lora_layer(i, layer, hidden, residual, positions, meta, lora)
                continue
            if residual is None:
                residual = hidden
                qkv = _linear(ops.rms_norm(hidden, layer.input_norm, eps), layer.qkv, layer.qkv_bias)
            elif fuse:
                qkv, residual = ops.add_rms_norm_linear(hidden, residual, layer.input_norm, layer.qkv, eps,
                                                        layer.qkv_bias)
            else:
                x, residual = ops.add_rms_norm(hidden, residual, layer.input_norm, eps)
                qkv = _linear(x, layer.qkv, layer.qkv_bias)
            x = self._reduced(_linear(self._attention(i, layer, qkv, positions, meta), layer.o))
            if fuse:
                gate_up, residual = ops.add_rms_norm_linear(x, residual, layer.post_norm, layer.gate_up, eps)
                hidden = ops.silu_and_mul_linear(gate_up, layer.down)
            else:
                x, residual = ops.add_rms_norm(x, residual, layer.post_norm, eps)
                hidden = _linear(ops.silu_and_mul(_linear(x, layer.gate_up)), layer.down)
            hidden = self._reduced(hidden)
        out, _ = ops.add_rms_norm(hidden, residual, self.norm, eps)
        return out

    def _lora_layer(self, i: int, layer: LayerWeights, hidden, residual, positions, meta: AttentionMetadata, lora):
        """One decoder layer with the adapters' deltas added to its projections: (its output, the residual)."""
        eps = self.config.rms_norm_eps
        if residual is None:
            residual, x = hidden, ops.rms_norm(hidden, layer.input_norm, eps)
        else:
            x, residual = ops.add_rms_norm(hidden, residual, layer.input_norm, eps)
        qkv = lora.add(i, "qkv", x, _linear(x, layer.qkv, layer.qkv_bias))
        o = self._attention(i, layer, qkv, positions, meta)
        x, residual = ops.add_rms_norm(self._reduced(lora.add(i, "o", o, _linear(o, layer.o))), residual,
                                       layer.post_norm, eps)
        act = ops.silu_and_mul(lora.add(i, "gate_up", x, _linear(x, layer.gate_up)))
        return self._reduced(lora.add(i, "down", act, _linear(act, layer.down))), residual

    def _reduced(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over a tensor-parallel group's ranks (``x`` itself on one device)."""
        return x if self.parallel is None else self.parallel.all_reduce(x)

    def _attention(self, i: int, layer: LayerWeights, qkv: torch.Tensor, positions, meta: AttentionMetadata):
        """Attention of a layer's q/k/v rows (after rope and the cache write), ``[T, Hq Dh]``, before the o projection."""
        c = self.config
        T = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(T, c.num_heads, c.head_dim)
        k = k.reshape(T, c.num_kv_heads, c.head_dim)
        v = v.reshape(T, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None:
            q = ops.rms_norm(q, layer.q_norm, c.rms_norm_eps)
            k = ops.rms_norm(k, layer.k_norm, c.rms_norm_eps)
        k_cache, v_cache = self.kv_caches[i]
        if meta.is_decode and self.rope_in_attention and not meta.drafts:  # (a draft row reads its neighbour's keys)
            try:  # the step's rope and cache write inside the attention kernel (one launch fewer per layer)
                o = ops.rope_cache_attention_decode(q, k, v, positions, self.cos_sin, k_cache, v_cache,
                                                    meta.slot_mapping, meta.block_tables, meta.context_lens,
                                                    scale=self.scale, is_neox=True)
                return o.reshape(T, self.q_size)
            except ops.UnsupportedError:  # a trimmed build without it: the separate kernels from now on
                self.rope_in_attention = False
        fused = getattr(self, "_rope_and_cache", True)
        if fused:
            try:  # one kernel on GPUs; elsewhere exactly rope then reshape_and_cache
                q, k = ops.rope_and_cache(q, k, v, positions, self.cos_sin, k_cache, v_cache, meta.slot_mapping,
                                          is_neox=True)
            except ops.UnsupportedError:  # a trimmed build without the fused operator: the pair from now on
                self._rope_and_cache = fused = False
        if not fused:
            q, k = ops.rope(q, k, positions, self.cos_sin, is_neox=True)
            ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode:
            o = ops.attention_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale=self.scale)
        elif meta.num_decodes:
            nd = meta.num_decodes
            o = ops.attention_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.decode_context_lens,
                                     scale=self.scale)
            if nd < T:  # (every row is a one-token row when a prompt chunk of one token is scored)
                o = torch.cat([o, self._prefill_attention(q[nd:], k[nd:], v[nd:], i, meta, meta.block_tables[nd:])])
        else:
            o = self._prefill_attention(q, k, v, i, meta, meta.block_tables)
        return o.reshape(T, self.q_size)

    def _prefill_attention(self, q, k, v, i: int, meta: AttentionMetadata, block_tables):
        if not meta.use_cache:
            return ops.attention_prefill(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, scale=self.scale,
                                         max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k)
        k_cache, v_cache = self.kv_caches[i]
        return ops.attention_prefill(q, None, None, meta.cu_seqlens_q, meta.cu_seqlens_k, scale=self.scale,
                                     k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                                     max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` in the model's dtype for hidden states ``[B, D]`` (the sampler casts to
        float32 where it needs to; greedy argmax reads them as they are)."""
        if self.lm_head is None:
            raise RuntimeError("this model has no output layer (its checkpoint holds the decoder alone): no logits")
        return _linear(hidden, self.lm_head)


def rope_in_attention_wanted(device="cpu") -> bool:
    """Whether decode steps rope and cache the step's keys inside the attention kernel
    (``ops.rope_cache_attention_decode``, one launch per layer fewer): by default on CUDA devices, where it
    measured 0.2-0.4% faster offline and 0.9% at batch 1 (H100), and where ``DecodeGraphs``' warm-up also runs
    the unfused kernels that steps mixing decodes with prefills launch; on CPUs the operator is the same two
    operators plus a check. ``NINEFOLD_ROPE_IN_ATTENTION=0`` or ``1`` overrides that (``ValueError`` for
    another value)."""
    setting = os.environ.get("NINEFOLD_ROPE_IN_ATTENTION", "")
    if setting == "":
        return torch.device(device).type == "cuda"
    if setting not in ("0", "1"):
        raise ValueError(f"NINEFOLD_ROPE_IN_ATTENTION: got {setting!r}; expected 0 (off) or 1 (on), or unset "
                         "(on for CUDA devices)")
    return setting == "1"


def _cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (avx512_bf16 / AMX), as oneDNN reports it."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _linear(x: torch.Tensor, weight: torch.Tensor | PackedLinear | ops.Fp8Weight,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    if type(weight) is PackedLinear:
        return weight(x, bias)
    if type(weight) is ops.Fp8Weight:
        return ops.linear_fp8(x, weight, bias)
    return ops.linear(x, weight, bias)


class _WeightReader:
    """Takes HF-named tensors out of a state dict, checking that each is there with its shape."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"checkpoint: tensor {name!r} is missing")
        tensor = self.tensors[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"checkpoint: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor


def random_weights(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict:
    """HF-named random weights of ``config``'s shape, made on ``device`` (for ``load_format='dummy'``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    c = config
    D, inter = c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def normal(*shape):
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

    def ones(n):
        return torch.ones(n, device=device, dtype=dtype)

    tensors = {"model.embed_tokens.weight": normal(c.vocab_size, D), "model.norm.weight": ones(D)}
    if not c.tie_word_embeddings:
        tensors["lm_head.weight"] = normal(c.vocab_size, D)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": ones(D), p + "post_attention_layernorm.weight": ones(D),
            p + "self_attn.q_proj.weight": normal(q, D), p + "self_attn.k_proj.weight": normal(kv, D),
            p + "self_attn.v_proj.weight": normal(kv, D), p + "self_attn.o_proj.weight": normal(D, q),
            p + "mlp.gate_proj.weight": normal(inter, D), p + "mlp.up_proj.weight": normal(inter, D),
            p + "mlp.down_proj.weight": normal(D, inter),
        })
        if c.attention_bias:
            for n, size in (("q", q), ("k", kv), ("v", kv)):
                tensors[p + f"self_attn.{n}_proj.bias"] = normal(size)
        if c.qk_norm:
            tensors[p + "self_attn.q_norm.weight"] = ones(c.head_dim)
            tensors[p + "self_attn.k_norm.weight"] = ones(c.head_dim)
    return tensors
