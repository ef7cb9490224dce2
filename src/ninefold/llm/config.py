"""Model and engine configuration: a Hugging Face ``config.json`` dict becomes a ``ModelConfig``.

One decoder definition (``models/llama.py``) serves every supported architecture; the
differences between them are the fields below (q/k/v bias, q/k RMSNorm, tied embeddings,
rope scaling), read from the config dict that both the HF loader and the GGUF loader return.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from ninefold.llm.pooling import POOLING_TYPES
from ninefold.llm.scheduler import POLICIES
from ninefold.llm.speculative import SpeculativeConfig
from ninefold.runtime.kv_pool import KV_CACHE_DTYPES

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
)

# The decoders without an output layer (transformers' base classes, which embedding checkpoints such as
# e5-mistral name) -> the family they belong to.
BASE_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
    "Phi3Model": "Phi3ForCausalLM",
}

# The architectures whose checkpoints store q/k/v (``qkv_proj``) and gate/up (``gate_up_proj``) stacked.
STACKED_PROJECTIONS = ("Phi3ForCausalLM",)

# config.json model_type -> architecture, for configs without an ``architectures`` entry.
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

# Shapes for ``load_format="dummy"`` (random weights, used by benchmarks).
NAMED_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
        num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32, rms_norm_eps=1e-5,
        rope_theta=500000.0, vocab_size=128256, max_position_embeddings=131072,
        tie_word_embeddings=False, head_dim=128, bos_token_id=128000, eos_token_id=128001,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
        num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=16, rms_norm_eps=1e-5,
        rope_theta=500000.0, vocab_size=128256, max_position_embeddings=131072,
        tie_word_embeddings=True, head_dim=64, bos_token_id=128000, eos_token_id=128001,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944,
        num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28, rms_norm_eps=1e-6,
        rope_theta=1000000.0, vocab_size=152064, max_position_embeddings=32768,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288,
        num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=36, rms_norm_eps=1e-6,
        rope_theta=1000000.0, vocab_size=151936, max_position_embeddings=40960,
        tie_word_embeddings=False, head_dim=128, bos_token_id=151643, eos_token_id=151645,
    ),
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
        num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30, rms_norm_eps=1e-5,
        rope_theta=100000.0, vocab_size=49152, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
}


def resolve_dtype(dtype: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """Turn ``"bfloat16"``, ``torch.float16``, ``"auto"`` or None into a torch dtype."""
    if dtype is None or dtype == "auto":
        return default
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.float16, torch.bfloat16):
            return dtype
    elif isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"dtype: got {dtype!r}; supported: float32, float16, bfloat16 or 'auto'")


@dataclass(frozen=True)
class ModelConfig:
    """The shape and variant switches of a Llama-family decoder."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # False for a checkpoint of the decoder alone (an embedding model): it embeds but cannot generate
    has_lm_head: bool = True
    # the head dimensions rope rotates (partial_rotary_factor * head_dim; 0: all of them)
    rotary_dim: int = 0
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, config: dict) -> ModelConfig:
        """Read a HF ``config.json`` dict; raises ValueError for unsupported architectures."""
        if not isinstance(config, dict):
            raise TypeError(f"config: expected a dict, got {type(config).__name__}")
        archs = config.get("architectures") or []
        if isinstance(archs, str):
            archs = [archs]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        base = arch is None and any(a in BASE_ARCHITECTURES for a in archs)
        if base:
            arch = next(BASE_ARCHITECTURES[a] for a in archs if a in BASE_ARCHITECTURES)
        if arch is None and not archs:
            # No architectures entry: transformers' AutoModelForCausalLM goes by model_type.
            arch = MODEL_TYPES.get(config.get("model_type"))
            if arch is None:
                raise ValueError(
                    f"architectures: missing, and model_type is {config.get('model_type')!r}; supported "
                    f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)} (model_type {', '.join(MODEL_TYPES)})"
                )
        if arch is None:
            raise ValueError(
                f"architectures: got {archs!r}; supported: {', '.join((*SUPPORTED_ARCHITECTURES, *BASE_ARCHITECTURES))}"
            )
        quant = config.get("quantization_config")
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise ValueError(
                f"quantization_config: got a checkpoint quantized with {method!r}; supported: unquantized "
                "float32/float16/bfloat16 safetensors (or a .gguf file, whose quantized matrices are supported); "
                "for FP8 weights load the unquantized checkpoint with quantization='fp8'"
            )
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: got {act!r}; supported: 'silu'")
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
            if key not in config:
                raise ValueError(f"config.json: missing required key {key!r}")
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_key_value_heads: got {kv_heads}, must divide num_attention_heads={heads}")
        head_dim = int(config.get("head_dim") or hidden // heads)
        rope_params = config.get("rope_parameters") or {}
        rotary_dim = _rotary_dim(config.get("partial_rotary_factor", rope_params.get("partial_rotary_factor")),
                                 head_dim, config.get("ninefold_rotary_dim"))
        rope_theta = float(config.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
        scaling = config.get("rope_scaling") or (rope_params if rope_params else None)
        if scaling is not None:
            if not isinstance(scaling, dict):
                raise ValueError(f"rope_scaling: got {scaling!r}; expected a dict with a rope_type (or null)")
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if arch == "Phi3ForCausalLM" and kind in ("su", "yarn"):
                kind = "longrope"  # older Phi-3 configs' names for it (transformers renames them the same way)
            if kind == "default":
                scaling = None
            elif kind == "llama3":
                _check_llama3_scaling(scaling)
            elif kind == "freq_factors":
                _check_freq_factors(scaling, rotary_dim)
            elif kind == "longrope":
                scaling = _longrope_scaling(scaling, config, rotary_dim,
                                            default_original=4096 if arch == "Phi3ForCausalLM" else None)
            else:
                raise ValueError(f"rope_scaling: got rope_type {kind!r}; supported: 'default', 'llama3', "
                                 "'freq_factors', 'longrope'")
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        sliding = config.get("sliding_window")
        # Qwen2/Qwen3 configs carry a sliding_window that only applies with use_sliding_window
        # (transformers sets it to None otherwise); Mistral's applies whenever it is set.
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not config.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            has_lm_head=not (config.get("ninefold_headless") or (base and not config.get("tie_word_embeddings"))),
            raw=dict(config),
            rotary_dim=rotary_dim,
        )

    @property
    def rotated_dim(self) -> int:
        """How many dimensions of each head rope rotates (``head_dim`` unless the rotary embedding is partial)."""
        return self.rotary_dim or self.head_dim


def _rotary_dim(partial, head_dim: int, exact=None) -> int:
    """The head dimensions rope rotates for ``partial_rotary_factor`` ``partial`` (None: all), as transformers
    computes them (``int(head_dim * partial)``), or ``exact`` when given (a GGUF's ``rope.dimension_count``); both
    it and the rest must be even (they rotate and pass in pairs)."""
    if exact is not None:
        rotary = exact
        if isinstance(rotary, bool) or not isinstance(rotary, int) or not 0 < rotary <= head_dim:
            raise ValueError(f"rope.dimension_count: got {rotary!r}; expected 1..{head_dim} (the head size)")
    elif partial is None:
        return head_dim
    elif isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ValueError(f"partial_rotary_factor: got {partial!r}; expected a number in (0, 1]")
    else:
        rotary = int(head_dim * partial)
    if rotary < 2 or rotary % 2 or (head_dim - rotary) % 2:
        given = f"rope.dimension_count: got {rotary}" if exact is not None else f"partial_rotary_factor: got {partial!r}"
        raise ValueError(f"{given}, which rotates {rotary} of the head's {head_dim} dimensions; supported: an even "
                         "count of at least 2 with an even remainder")
    return rotary


def _check_llama3_scaling(scaling: dict) -> None:
    """rope_type 'llama3' needs a positive factor, and low_freq_factor < high_freq_factor."""
    numbers = {key: scaling.get(key, default) for key, default in (
        ("factor", None), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
        ("original_max_position_embeddings", 8192))}
    for key, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"rope_scaling: rope_type 'llama3' needs {key} (a number > 0); got {value!r} "
                             f"in {scaling!r}")
    if not numbers["low_freq_factor"] < numbers["high_freq_factor"]:
        raise ValueError(f"rope_scaling: rope_type 'llama3' needs low_freq_factor < high_freq_factor; got "
                         f"{numbers['low_freq_factor']!r} and {numbers['high_freq_factor']!r}")


def _longrope_scaling(scaling: dict, config: dict, head_dim: int, default_original: int | None = None) -> dict:
    """rope_type 'longrope' (Phi-3.5, Phi-3 128k) checked and completed: ``short_factor`` and ``long_factor`` (head_dim
    / 2 positive numbers each; ``head_dim``: the rotated dimensions), ``original_max_position_embeddings`` (the pretraining context; Phi-3's default 4096)
    and the ``attention_factor`` cos and sin are scaled by (given, else transformers' rule: ``sqrt(1 + ln(s) /
    ln(original))`` with ``s`` the ``factor`` given, else ``max_position_embeddings / original``; 1 when ``s <= 1``)."""
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if (not isinstance(factors, (list, tuple)) or len(factors) != head_dim // 2
                or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f < math.inf
                           for f in factors)):
            shown = factors if not isinstance(factors, (list, tuple)) else f"{len(factors)} values"
            raise ValueError(f"rope_scaling: rope_type 'longrope' needs {key}, {head_dim // 2} positive finite numbers "
                             f"(one per rotated pair of head dimensions); got {shown}")
    longest = int(config.get("max_position_embeddings", 4096))
    original = config.get("original_max_position_embeddings",
                          scaling.get("original_max_position_embeddings", default_original))
    if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original < 1):
        raise ValueError(f"original_max_position_embeddings: got {original!r}; expected a positive integer")
    for key in ("factor", "attention_factor"):
        value = scaling.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < math.inf):
            raise ValueError(f"rope_scaling: rope_type 'longrope' needs {key} to be a positive number or absent; "
                             f"got {value!r}")
    stretch = scaling.get("factor") or (longest / original if original else 1.0)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if stretch <= 1 else math.sqrt(1 + math.log(stretch) / math.log(original or longest))
    return {"rope_type": "longrope", "short_factor": [float(f) for f in scaling["short_factor"]],
            "long_factor": [float(f) for f in scaling["long_factor"]],
            "original_max_position_embeddings": int(original or longest), "attention_factor": float(attention)}


def _check_freq_factors(scaling: dict, head_dim: int) -> None:
    """rope_type 'freq_factors' (ninefold's form of a GGUF ``rope_freqs`` tensor) needs ``freq_factors``: one
    positive number per rotated pair, ``head_dim / 2`` of them."""
    factors = scaling.get("freq_factors")
    if (not isinstance(factors, (list, tuple)) or len(factors) != head_dim // 2
            or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f < math.inf for f in factors)):
        shown = factors if not isinstance(factors, (list, tuple)) else f"{len(factors)} values"
        raise ValueError(f"rope_scaling: rope_type 'freq_factors' needs freq_factors, {head_dim // 2} positive finite "
                         f"numbers (one per rotated pair of head dimensions); got {shown}")


def rope_inv_freq(config: ModelConfig, max_positions: int | None = None) -> torch.Tensor:
    """The rotary frequencies ``[rotated_dim / 2]`` float32, scaled as ``config.rope_scaling`` says: llama3's
    smooth interpolation, or per-frequency divisors (``freq_factors``: ``inv_freq / factor``, as llama.cpp
    applies a GGUF's ``rope_freqs``; ``longrope``: its long factors when the engine's context ``max_positions``
    exceeds the pretraining one, else its short factors)."""
    dim = config.rotated_dim
    # float32 throughout, rounding the way the reference implementation (transformers) does
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.get("rope_type") == "longrope":
        long = max_positions is not None and max_positions > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * config.rope_theta ** exponents)
    if scaling.get("rope_type", scaling.get("type")) == "freq_factors":
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    return _llama3_scale(inv_freq, scaling)


def rope_cos_sin_cache(config: ModelConfig, max_positions: int, device=None, context: int | None = None) -> torch.Tensor:
    """``[max_positions, head_dim]`` float32: cos in the first half of the columns, sin in the rest (the rotated
    pairs' both times longrope's ``attention_factor``, as transformers scales them). ``context``: the longest
    sequence the engine runs, which picks longrope's factors (default ``max_positions``).

    With a partial rotary embedding the pairs past the rotated ones get cos 1 and sin 0 (left as they are): the
    model stores each head's q/k dimensions in ``rotary_head_order``, which puts the passed dimensions there."""
    inv_freq = rope_inv_freq(config, context or max_positions)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") == "longrope":
        cos, sin = cos * scaling["attention_factor"], sin * scaling["attention_factor"]
    passed = (config.head_dim - config.rotated_dim) // 2
    if passed:
        cos = torch.cat([cos, torch.ones(max_positions, passed)], dim=-1)
        sin = torch.cat([sin, torch.zeros(max_positions, passed)], dim=-1)
    return torch.cat([cos, sin], dim=-1).to(device)


def rotary_head_order(config: ModelConfig) -> list[int] | None:
    """With a partial rotary embedding, the order in which the model stores each head's q and k dimensions: rope
    rotates dimension ``i`` with ``i + rotated_dim / 2`` (transformers' halves of the rotated part), and the
    kernels rotate ``i`` with ``i + head_dim / 2`` over the whole head; this order makes each rotated pair a kernel
    pair and each passed dimension one whose table entry is cos 1, sin 0. Attention scores do not change (q and k
    are permuted alike). ``None`` when rope rotates the whole head."""
    d, r = config.head_dim, config.rotated_dim
    if r == d:
        return None
    half, rest = r // 2, (d - r) // 2
    return [*range(half), *range(r, r + rest), *range(half, r), *range(r + rest, d)]


def rotary_rows(rows: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """q or k rows of whole heads (``[heads * head_dim, ...]``: projection weights, biases, LoRA B matrices) in
    ``rotary_head_order``; ``rows`` itself when rope rotates the whole head."""
    order = rotary_head_order(config)
    if order is None:
        return rows
    heads = rows.shape[0] // config.head_dim
    index = (torch.arange(heads)[:, None] * config.head_dim + torch.tensor(order)[None, :]).reshape(-1)
    return rows[index.to(rows.device)]


def rope_fingerprint(config: ModelConfig, max_positions: int) -> int:
    """A number that differs between rotary tables that rotate keys differently (head size, rotated dimensions, base,
    scaling, and for longrope the factors an engine of ``max_positions`` picks): cached keys carry it between engines."""
    scaling = dict(config.rope_scaling or {})
    if scaling.get("rope_type") == "longrope":
        scaling["long"] = max_positions > scaling["original_max_position_embeddings"]
    partial = [config.rotated_dim] if config.rotated_dim != config.head_dim else []
    text = json.dumps([config.head_dim, config.rope_theta, scaling, *partial], sort_keys=True)
    return zlib.crc32(text.encode())


def projection_shapes(architecture: str, hidden: int, q: int, kv: int, intermediate: int) -> dict[str, tuple]:
    """A layer's q/k/v and gate/up weights as ``architecture``'s checkpoints store them: HF names under
    ``model.layers.{i}.`` -> shape (stacked for ``STACKED_PROJECTIONS``)."""
    if architecture in STACKED_PROJECTIONS:
        return {"self_attn.qkv_proj.weight": (q + 2 * kv, hidden), "mlp.gate_up_proj.weight": (2 * intermediate, hidden)}
    return {"self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
            "self_attn.v_proj.weight": (kv, hidden), "mlp.gate_proj.weight": (intermediate, hidden),
            "mlp.up_proj.weight": (intermediate, hidden)}


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


QUANTIZATION_MODES = ("auto", "int4", "none", "fp8")


@dataclass
class EngineConfig:
    """Engine knobs; every field can be passed to ``LLM(...)`` / ``LLMEngine(...)`` as a keyword."""

    dtype: str | torch.dtype | None = "auto"
    device: str | torch.device | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_kv_blocks: int | None = None
    # KV-cache sizing on accelerators (one of the two; neither: kv_cache_memory_fraction 0.9).
    # kv_cache_memory_fraction: the share of the device's memory in use once the pool is made, counting
    # whatever else holds memory there. gpu_memory_utilization (vLLM's): the share this engine may use in
    # all (weights, activations, graphs, KV cache), whatever else runs on the device.
    kv_cache_memory_fraction: float | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    # What the KV cache holds (vLLM's kv_cache_dtype): "auto", the model's dtype; "fp8" (or "fp8_e4m3"): FP8 codes
    # (float8_e4m3fn, no scale: values beyond +-448 saturate), half of bfloat16's bytes per token.
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    cuda_graph_max_batch: int = 256
    # Prepare and launch step n+1 while the device runs step n (None: on for CUDA devices). A
    # sequence that stops at step n (EOS, stop string) has one wasted row in step n+1.
    async_scheduling: bool | None = None
    load_format: str = "auto"
    # A Hugging Face tokenizer directory to use instead of the model's own (vLLM's ``tokenizer``): its
    # tokenizer.json and tokenizer_config.json (special tokens, chat template); the generation config stays the model's.
    tokenizer: str | None = None
    # GGUF 4-bit and Q8_0 matrices: "auto" keeps them packed where that is the fast path (bfloat16
    # on CPUs), "int4" keeps them packed on any device and dtype, "none" dequantizes everything to
    # ``dtype`` (the exact path). "fp8" (vLLM's online FP8) stores every layer's projection matrices, of
    # any checkpoint, as FP8 with a scale per output channel (``ops.Fp8Weight``): W8A8 on GPUs with FP8
    # tensor cores, weight-only elsewhere; the embedding and output layer stay in ``dtype``.
    quantization: str = "auto"
    seed: int = 0
    # Ranks that each hold a slice of every layer (Megatron-style; ``ninefold.llm.parallel``): this
    # process is rank 0 and starts the others, on consecutive GPUs from ``device`` or all on the CPU.
    tensor_parallel_size: int = 1
    # Speculative decoding (``ninefold.llm.speculative``): vLLM's dict, e.g. {"method": "ngram",
    # "num_speculative_tokens": 4, "prompt_lookup_max": 4}; None: off.
    speculative_config: dict | None = None
    # "fcfs", or "priority": requests' ``priority`` (lower first) orders admission, budget and preemption
    scheduling_policy: str = "fcfs"
    # How embeddings pool the prompt's hidden states ("LAST", "MEAN" or "CLS"); None: what the model's
    # files say (``ninefold.llm.pooling``), else LAST.
    pooling_type: str | None = None
    # LoRA adapters (``ninefold.llm.lora``, vLLM's options): requests may name an adapter (``lora_request``);
    # ``max_loras`` adapters share a step, each of rank <= ``max_lora_rank``; ``max_cpu_loras`` (None: as many
    # as ``max_loras``) adapters read from disk are kept for later requests.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        positive = ("max_num_seqs", "max_num_batched_tokens", "block_size", "cuda_graph_max_batch",
                    "tensor_parallel_size", "max_loras", "max_lora_rank")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: got {value!r}; expected a positive integer")
        for name in ("enable_lora", "enable_prefix_caching", "enforce_eager"):
            value = getattr(self, name)
            if not isinstance(value, bool):  # (a string such as "false" would read as True)
                raise ValueError(f"{name}: got {value!r}; expected True or False")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed: got {self.seed!r}; expected an integer")
        if self.max_cpu_loras is not None and isinstance(self.max_cpu_loras, int) and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras: got {self.max_cpu_loras}; expected at least max_loras ({self.max_loras})")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: got {self.kv_cache_dtype!r}; supported: "
                             f"{', '.join(repr(k) for k in KV_CACHE_DTYPES)} (fp8_e5m2 is not)")
        if self.tokenizer is not None:
            if not isinstance(self.tokenizer, (str, os.PathLike)):
                raise ValueError(f"tokenizer: got {self.tokenizer!r}; expected the path of a tokenizer directory")
            self.tokenizer = os.fspath(self.tokenizer)
        for name in ("max_model_len", "num_kv_blocks", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}: got {value!r}; expected a positive integer or None")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling: got {self.async_scheduling!r}; expected True, False or None (auto)")
        for name in ("kv_cache_memory_fraction", "gpu_memory_utilization"):
            fraction = getattr(self, name)
            if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                         or not 0 < fraction <= 1):
                raise ValueError(f"{name}: got {fraction!r}; expected a number in (0, 1] or None")
        if self.kv_cache_memory_fraction is not None and self.gpu_memory_utilization is not None:
            raise ValueError(f"gpu_memory_utilization: got {self.gpu_memory_utilization!r} beside "
                             f"kv_cache_memory_fraction={self.kv_cache_memory_fraction!r}; give one of the two")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format: got {self.load_format!r}; supported: 'auto', 'dummy'")
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization: got {self.quantization!r}; supported: "
                             f"{', '.join(repr(m) for m in QUANTIZATION_MODES)}")
        resolve_dtype(self.dtype)
        SpeculativeConfig.parse(self.speculative_config)
        if self.pooling_type is not None and str(self.pooling_type).upper() not in POOLING_TYPES:
            raise ValueError(f"pooling_type: got {self.pooling_type!r}; supported: {', '.join(POOLING_TYPES)} or None "
                             "(the model's own)")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy: got {self.scheduling_policy!r}; supported: {', '.join(POLICIES)}")


def split_engine_args(kwargs: dict) -> EngineConfig:
    """Build an EngineConfig from keyword arguments; unknown keywords raise TypeError naming them."""
    known = set(EngineConfig.__dataclass_fields__)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"unknown engine argument(s) {unknown}; accepted: {sorted(known)}")
    config = EngineConfig(**kwargs)
    config.validate()
    return config
